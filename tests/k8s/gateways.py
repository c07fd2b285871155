"""Helpers that drive InferenceGateways and InferenceModels through the real kubectl."""

from __future__ import annotations

import json
from typing import Any

from k8s.controlplane import ControlPlane
from k8s.pools import CONVERGE_S, open_router
from k8s.support import wait_for

HASH = "kvflow.io/router-config-sha256"


def manifest(kind: str, namespace: str, name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {
            "apiVersion": "kvflow.io/v1alpha1",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": open_router(spec) if kind in ("InferencePool", "InferenceGateway") else spec,
        }
    )


def apply(cluster: ControlPlane, kind: str, namespace: str, name: str, spec: Any) -> None:
    cluster.kubectl("apply", "-f", "-", input=manifest(kind, namespace, name, spec))


def model_spec(gateway: str, **weights: int) -> dict[str, Any]:
    return {
        "gatewayRef": {"name": gateway},
        "aliases": ["chat"],
        "targets": [{"poolRef": {"name": p}, "weight": w} for p, w in weights.items()],
    }


# Pools behind one gateway share a worker token: the gateway presents one.
SHARED_TOKEN = {"name": "shared-worker-token", "key": "token"}


def pool_spec(served: str) -> dict[str, Any]:
    return {
        "model": {"servedName": served},
        "engine": {"simulate": True},
        "workerTokenSecret": SHARED_TOKEN,
    }


def get(cluster: ControlPlane, kind: str, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", kind, name, "-n", namespace)
    return found


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        (c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {}
    )
    return found


def wait_gateway(
    cluster: ControlPlane, namespace: str, name: str, phase: str, models: list[Any]
) -> dict[str, Any]:
    """The gateway once its status, at its current generation, has `phase` and `models`."""

    def reached() -> dict[str, Any] | None:
        gateway = get(cluster, "inferencegateway", namespace, name)
        status = gateway.get("status", {})
        current = status.get("observedGeneration") == gateway["metadata"]["generation"]
        done = current and status.get("phase") == phase and status.get("models") == models
        return gateway if done else None

    result: dict[str, Any] = wait_for(reached, CONVERGE_S, f"gateway {name} {phase}")
    return result


def resolved(v1: int, v2: int) -> list[dict[str, Any]]:
    return [
        {
            "name": "smollm2",
            "aliases": ["chat"],
            "targets": [{"pool": "smol-v1", "weight": v1}, {"pool": "smol-v2", "weight": v2}],
            "source": "smollm2",
        }
    ]
