"""Helpers that drive InferencePools through the real kubectl."""

from __future__ import annotations

import json
from typing import Any

from k8s.controlplane import ControlPlane
from k8s.support import wait_for

# Generous: two shared cores run the control plane, the operator and other suites' tests.
CONVERGE_S = 120


def open_router(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` (a pool's or a gateway's) with router.allowUnauthenticated set, unless it
    names tenants or says so itself: most tests are about something else than the
    gateway's tenants, which the CRD otherwise requires (tests/k8s/test_secure_defaults.py)."""
    router = spec.get("router") or {}
    if "tenantsSecret" in router or "allowUnauthenticated" in router:
        return spec
    return {**spec, "router": {**router, "allowUnauthenticated": True}}


def pool_manifest(namespace: str, name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {
            "apiVersion": "kvflow.io/v1alpha1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": open_router(spec),
        }
    )


def apply_pool(cluster: ControlPlane, namespace: str, name: str, spec: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=pool_manifest(namespace, name, spec))


def replica_owners(cluster: ControlPlane, namespace: str, deployment: str) -> tuple[int, list[str]]:
    """A Deployment's spec.replicas and the field managers that hold it."""
    got = cluster.kubectl_json(
        "get", "deployment", deployment, "-n", namespace, "--show-managed-fields"
    )
    owners = [
        m["manager"]
        for m in got["metadata"]["managedFields"]
        if "f:replicas" in m.get("fieldsV1", {}).get("f:spec", {})
    ]
    return int(got["spec"].get("replicas", 0)), owners


def get_pool(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    pool: dict[str, Any] = cluster.kubectl_json("get", "inferencepool", name, "-n", namespace)
    return pool


def wait_ready(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    """Wait for phase Ready at the current generation; the pool as then read."""

    def ready() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, name)
        status = pool.get("status", {})
        current = status.get("observedGeneration") == pool["metadata"]["generation"]
        return pool if current and status.get("phase") == "Ready" else None

    result: dict[str, Any] = wait_for(ready, CONVERGE_S, f"pool {namespace}/{name} Ready")
    return result


def children(cluster: ControlPlane, namespace: str, pool: str, kind: str) -> list[dict[str, Any]]:
    listed = cluster.kubectl_json("get", kind, "-n", namespace, "-l", f"kvflow.io/pool={pool}")
    items: list[dict[str, Any]] = listed["items"]
    return items


def child_names(cluster: ControlPlane, namespace: str, pool: str, kind: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in children(cluster, namespace, pool, kind))


def condition(pool: dict[str, Any], type_: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        c for c in pool.get("status", {}).get("conditions", []) if c["type"] == type_
    )
    return found


def pool_events(cluster: ControlPlane, namespace: str, name: str) -> list[tuple[str, str]]:
    """(reason, message) of the Events about a pool, oldest first."""
    events = cluster.kubectl_json(
        "get", "events", "-n", namespace, "--sort-by=.lastTimestamp",
        "--field-selector", f"involvedObject.kind=InferencePool,involvedObject.name={name}",
    )  # fmt: skip
    return [(e["reason"], e["message"]) for e in events["items"]]


def event_reasons(cluster: ControlPlane, namespace: str, name: str) -> list[str]:
    return [reason for reason, _ in pool_events(cluster, namespace, name)]


SMALL_SPEC: dict[str, Any] = {
    "model": {"servedName": "smollm2-135m-instruct"},
    "engine": {"simulate": True},
    "colocated": {"replicas": 2},
}
