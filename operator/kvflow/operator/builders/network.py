"""A pool's NetworkPolicies: who may reach its workers and its routers (pure).

Worker gRPC is where prompts go in, KV events come out and requests are aborted, and the
KV port is where prefill workers push blocks: only the pool's own router, its workers, and
the routers of InferenceGateways fronting the pool (labelled fronts.kvflow.io/<pool>), may
reach them. Between the pool's own workers every port is open: the gloo and NCCL KV
transports (and tensor-parallel groups) listen on ports the OS picks, so a list of ports
would keep a disaggregated pool from ever forming its group. Everything else in the cluster
(another pool, another tenant's pod, a compromised sidecar) is refused by the cluster's
network plugin. The metrics ports stay open to any pod: Prometheus and the operator's
planner scrape them, and they serve only counters and probes.

A pool's routers take tenants' requests on their HTTP port from anywhere (the router
authenticates them itself) and metrics on their metrics port; nothing else.

A NetworkPolicy is enforced by the cluster's network plugin (Calico, Cilium, ...); on a
cluster without one it is accepted and has no effect.
"""

from __future__ import annotations

from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_POOL,
    ROUTER_HTTP_PORT,
    ROUTER_METRICS_PORT,
    WORKER_GRPC_PORT,
    WORKER_METRICS_PORT,
    PoolRef,
    fronts_label,
    metadata,
)


def workers_network_policy_name(pool: PoolRef) -> str:
    return f"{pool.name}-workers"


def router_network_policy_name(pool: PoolRef) -> str:
    return f"{pool.name}-router"


def workers_network_policy(pool: PoolRef) -> dict[str, Json]:
    own_workers = {
        "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"}}
    }
    own_router = {
        "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "router"}}
    }
    gateways = {"podSelector": {"matchLabels": {fronts_label(pool.name): "true"}}}
    grpc = {"protocol": "TCP", "port": WORKER_GRPC_PORT}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(pool, workers_network_policy_name(pool), "worker", "workers"),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                # The pool's workers, on every port: the KV port, and the gloo/NCCL
                # transports' ports, which the OS picks.
                {"from": [own_workers]},
                # The pool's router (generation, KV events, health) and the routers of
                # InferenceGateways whose models target the pool: gRPC only.
                {"from": [own_router, gateways], "ports": [grpc]},
                {"ports": [{"protocol": "TCP", "port": WORKER_METRICS_PORT}]},
            ],
        },
    }


def router_network_policy(pool: PoolRef) -> dict[str, Json]:
    return router_ingress_policy(
        metadata(pool, router_network_policy_name(pool), "router", "router"),
        {LABEL_POOL: pool.name, LABEL_COMPONENT: "router"},
    )


def router_ingress_policy(meta: dict[str, Json], select: dict[str, str]) -> dict[str, Json]:
    """Routers (a pool's or an InferenceGateway's) take requests and scrapes only."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": dict(select)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    # Tenants, through the gateway Service (authenticated by the router),
                    # and Prometheus and the planner on the metrics port.
                    "ports": [
                        {"protocol": "TCP", "port": ROUTER_HTTP_PORT},
                        {"protocol": "TCP", "port": ROUTER_METRICS_PORT},
                    ]
                }
            ],
        },
    }
