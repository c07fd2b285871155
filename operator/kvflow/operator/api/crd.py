"""The kvflow.io CustomResourceDefinitions, built from the typed API (pure).

`tools/k8s/gen_crds.py` writes it to crds/ and the chart; tests apply that file.
"""

from __future__ import annotations

from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api import v1alpha1_gateway as gw
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

_GATEWAY_COLUMNS: list[dict[str, Json]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_MODEL_COLUMNS: list[dict[str, Json]] = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.modelName"},
    {"name": "Gateway", "type": "string", "jsonPath": ".spec.gatewayRef.name"},
    {
        "name": "Accepted",
        "type": "string",
        "jsonPath": ".status.conditions[?(@.type=='Accepted')].status",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def inference_pool_crd() -> dict[str, Json]:
    return _crd(
        kind=v1alpha1.KIND,
        plural=v1alpha1.PLURAL,
        singular=v1alpha1.SINGULAR,
        short_names=v1alpha1.SHORT_NAMES,
        spec_cls=v1alpha1.InferencePoolSpec,
        status_cls=v1alpha1_status.InferencePoolStatus,
        spec_description="Desired state of the pool.",
        columns=_PRINTER_COLUMNS,
        name_rules=[
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
    )


def inference_gateway_crd() -> dict[str, Json]:
    return _crd(
        kind=gw.GATEWAY_KIND,
        plural=gw.GATEWAY_PLURAL,
        singular=gw.GATEWAY_SINGULAR,
        short_names=gw.GATEWAY_SHORT_NAMES,
        spec_cls=gw.InferenceGatewaySpec,
        status_cls=gw.InferenceGatewayStatus,
        spec_description="Desired state of the gateway.",
        columns=_GATEWAY_COLUMNS,
        name_rules=[
            {
                # Its Service is named after it, its Deployment <gateway>-gateway.
                "rule": "self.metadata.name.size() <= 40",
                "message": "an InferenceGateway name must be at most 40 characters",
            },
            {
                "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
                "message": "an InferenceGateway name must start with a letter "
                "(its Service is named after it)",
            },
            {
                # An InferencePool p owns Services p-gateway and p-workers: a gateway of
                # such a name would fight the pool over its Service.
                "rule": "!self.metadata.name.endsWith('-gateway') && "
                "!self.metadata.name.endsWith('-workers')",
                "message": "an InferenceGateway name must not end in -gateway or -workers "
                "(InferencePools name their Services so)",
            },
        ],
    )


def inference_model_crd() -> dict[str, Json]:
    return _crd(
        kind=gw.MODEL_KIND,
        plural=gw.MODEL_PLURAL,
        singular=gw.MODEL_SINGULAR,
        short_names=gw.MODEL_SHORT_NAMES,
        spec_cls=gw.InferenceModelSpec,
        status_cls=gw.InferenceModelStatus,
        spec_description="Desired state of the model.",
        columns=_MODEL_COLUMNS,
        name_rules=[],
    )


def all_crds() -> list[dict[str, Json]]:
    """Every CRD of the kvflow.io group, as tools/k8s/gen_crds.py writes them."""
    return [inference_pool_crd(), inference_gateway_crd(), inference_model_crd()]


def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: tuple[str, ...],
    spec_cls: type,
    status_cls: type,
    spec_description: str,
    columns: list[dict[str, Json]],
    name_rules: list[dict[str, Json]],
) -> dict[str, Json]:
    root: dict[str, Json] = {
        "type": "object",
        "description": " ".join((spec_cls.__doc__ or "").split()),
        "properties": {
            "apiVersion": {"type": "string", "description": "The API version, kvflow.io/v1alpha1."},
            "kind": {"type": "string", "description": f"{kind}."},
            "metadata": {"type": "object"},
            "spec": {
                "description": spec_description,
                **_without_description(record_schema(spec_cls)),
            },
            "status": {
                "description": "Observed state, written by the operator.",
                **_without_description(record_schema(status_cls)),
            },
        },
        "required": ["spec"],
    }
    if name_rules:
        root["x-kubernetes-validations"] = name_rules
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{v1alpha1.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvflow"},
        },
        "spec": {
            "group": v1alpha1.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["kvflow"],
            },
            "versions": [
                {
                    "name": v1alpha1.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def _without_description(schema: dict[str, Json]) -> dict[str, Json]:
    return {k: v for k, v in schema.items() if k != "description"}
