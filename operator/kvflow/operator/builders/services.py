"""A pool's Services and PodDisruptionBudgets (pure)."""

from __future__ import annotations

from kvflow.operator.api import v1alpha1_router
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_POOL,
    WORKER_GRPC_PORT,
    WORKER_METRICS_PORT,
    Component,
    PoolRef,
    gateway_service_name,
    metadata,
    selector_labels,
    workers_service_name,
)


def workers_service(pool: PoolRef) -> dict[str, Json]:
    """Headless: its DNS A records are the ready workers of every role, which the router
    re-resolves to discover workers (and asks each for its role)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pool, workers_service_name(pool), "worker", "workers"),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"},
            "publishNotReadyAddresses": False,
            "ports": [
                {"name": "grpc", "port": WORKER_GRPC_PORT, "targetPort": "grpc"},
                {"name": "metrics", "port": WORKER_METRICS_PORT, "targetPort": "metrics"},
            ],
        },
    }


def gateway_service(pool: PoolRef, router: v1alpha1_router.RouterSpec) -> dict[str, Json]:
    """What tenants call: the OpenAI API of the router replicas."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pool, gateway_service_name(pool), "router", "router"),
        "spec": {
            "type": router.service_type,
            "selector": selector_labels(pool, "router"),
            "ports": [
                {
                    "name": "http",
                    "port": router.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def disruption_budget(pool: PoolRef, name: str, role: str) -> dict[str, Json]:
    """At most one pod of a Deployment evicted at a time by drains and upgrades.

    maxUnavailable, not minAvailable: with one replica, minAvailable 1 would block every
    node drain forever; maxUnavailable 1 lets it through while still serialising larger
    roles so a drain never empties one.
    """
    component: Component = "router" if role == "router" else "worker"
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(pool, name, component, role),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(pool, role)},
        },
    }
