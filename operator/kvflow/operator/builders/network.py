"""A pool's NetworkPolicy: who may reach its workers (pure).

Worker gRPC is where prompts go in, KV events come out and requests are aborted, and the
KV port is where prefill workers push blocks: only the pool's own router and workers, and
the routers of InferenceGateways fronting the pool (labelled fronts.kvflow.io/<pool>), may
reach them. Everything else in the cluster (another pool, another tenant's pod, a
compromised sidecar) is refused by the cluster's network plugin. The metrics port stays
open to any pod: Prometheus and the operator's planner scrape it, and it serves only
counters and probes. Routers are not restricted here: tenants reach them through the
gateway Service, and the router authenticates them itself.

A NetworkPolicy is enforced by the cluster's network plugin (Calico, Cilium, ...); on a
cluster without one it is accepted and has no effect.
"""

from __future__ import annotations

from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_POOL,
    WORKER_GRPC_PORT,
    WORKER_KV_PORT,
    WORKER_METRICS_PORT,
    PoolRef,
    fronts_label,
    metadata,
)


def workers_network_policy_name(pool: PoolRef) -> str:
    return f"{pool.name}-workers"


def workers_network_policy(pool: PoolRef) -> dict[str, Json]:
    own_pods = {"podSelector": {"matchLabels": {LABEL_POOL: pool.name}}}
    gateways = {"podSelector": {"matchLabels": {fronts_label(pool.name): "true"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(pool, workers_network_policy_name(pool), "worker", "workers"),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    # The pool's router (generation, KV events, health) and its workers
                    # (KV blocks from prefill to decode).
                    "from": [own_pods],
                    "ports": [
                        {"protocol": "TCP", "port": WORKER_GRPC_PORT},
                        {"protocol": "TCP", "port": WORKER_KV_PORT},
                    ],
                },
                # The routers of InferenceGateways whose models target the pool: gRPC only.
                {"from": [gateways], "ports": [{"protocol": "TCP", "port": WORKER_GRPC_PORT}]},
                {"ports": [{"protocol": "TCP", "port": WORKER_METRICS_PORT}]},
            ],
        },
    }
