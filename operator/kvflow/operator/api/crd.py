"""The InferencePool CustomResourceDefinition, built from the typed API (pure).

`tools/k8s/gen_crds.py` writes it to crds/ and the chart; tests apply that file.
"""

from __future__ import annotations

from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api.schema import Json, record_schema

CRD_NAME = f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}"

_PRINTER_COLUMNS: list[dict[str, Json]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName"},
    {
        "name": "Ready",
        "type": "integer",
        "jsonPath": ".status.readyReplicas",
        "description": "Ready worker pods, all roles",
    },
    {
        "name": "Desired",
        "type": "integer",
        "jsonPath": ".status.desiredReplicas",
        "description": "Worker pods asked for, all roles",
    },
    {
        "name": "Gateway",
        "type": "string",
        "jsonPath": ".status.gatewayEndpoint",
        "priority": 1,  # shown by `kubectl get -o wide` only: URLs are long
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def inference_pool_crd() -> dict[str, Json]:
    root: dict[str, Json] = {
        "type": "object",
        "description": " ".join((v1alpha1.InferencePoolSpec.__doc__ or "").split()),
        "properties": {
            "apiVersion": {"type": "string", "description": "The API version, kvflow.io/v1alpha1."},
            "kind": {"type": "string", "description": "InferencePool."},
            "metadata": {"type": "object"},
            "spec": {
                "description": "Desired state of the pool.",
                **_without_description(record_schema(v1alpha1.InferencePoolSpec)),
            },
            "status": {
                "description": "Observed state, written by the operator.",
                **_without_description(record_schema(v1alpha1_status.InferencePoolStatus)),
            },
        },
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                # Children are named <pool>-<role>; Services need DNS-1035 labels of at most
                # 63 characters and the longest suffix is "-colocated" plus a hash margin.
                "rule": "self.metadata.name.size() <= 40",
                "message": "an InferencePool name must be at most 40 characters",
            },
            {
                "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "message": "an InferencePool name must start with a letter "
                "(its Services are named after it)",
            },
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "kvflow"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": v1alpha1.KIND,
                "listKind": f"{v1alpha1.KIND}List",
                "plural": v1alpha1.PLURAL,
                "singular": v1alpha1.SINGULAR,
                "shortNames": list(v1alpha1.SHORT_NAMES),
                "categories": ["kvflow"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def _without_description(schema: dict[str, Json]) -> dict[str, Json]:
    return {k: v for k, v in schema.items() if k != "description"}
