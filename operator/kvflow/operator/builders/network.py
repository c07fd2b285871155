"""A pool's NetworkPolicies: who may reach its workers and its routers (pure).

Worker gRPC is where prompts go in, KV events come out and requests are aborted, and the
KV port is where prefill workers push blocks: only the pool's own router, its workers, and
the routers of InferenceGateways fronting the pool (labelled fronts.kvflow.io/<pool>), may
reach them. Between the pool's own workers every port is open: the gloo and NCCL KV
transports (and tensor-parallel groups) listen on ports the OS picks, so a list of ports
would keep a disaggregated pool from ever forming its group. Everything else in the cluster
(another pool, another tenant's pod, a compromised sidecar) is refused by the cluster's
network plugin.

The metrics ports (workers' and routers') admit only the namespaces the operator's
administrator names (``MetricsScrapers``: the operator's own, where its planner scrapes the
pods, and Prometheus'): a router's metrics carry every tenant's name and usage, which no
other tenant's pod should read. The kubelet's probes on those ports come from the node,
which a NetworkPolicy always admits.

A pool's routers take tenants' requests on their HTTP port from anywhere (the router
authenticates them itself) and scrapes on their metrics port; nothing else.

A NetworkPolicy is enforced by the cluster's network plugin (Calico, Cilium, ...); on a
cluster without one it is accepted and has no effect.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# Every namespace carries this label, set by the API server to the namespace's name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class MetricsScrapers:
    """Who may reach the metrics ports: pods in ``namespaces``, or any pod with
    ``any_namespace`` (``kvflow operator --metrics-scraper-namespace '*'``). The default
    admits no pod at all (the node's probes still pass)."""

    namespaces: tuple[str, ...] = ()
    any_namespace: bool = False

    def ingress_rule(self, port: int) -> dict[str, Json] | None:
        """The NetworkPolicy ingress rule for ``port``; None admits no pod."""
        ports: list[Json] = [{"protocol": "TCP", "port": port}]
        if self.any_namespace:
            return {"ports": ports}
        if not self.namespaces:
            return None
        peers: list[Json] = [
            # podSelector {} beside the namespace: every pod there, hostNetwork ones
            # included on plugins that tell them apart (OpenShift's).
            {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}, "podSelector": {}}
            for ns in self.namespaces
        ]
        return {"from": peers, "ports": ports}


NO_SCRAPERS = MetricsScrapers()  # the default: no pod reaches a metrics port


def workers_network_policy_name(pool: PoolRef) -> str:
    return f"{pool.name}-workers"


def router_network_policy_name(pool: PoolRef) -> str:
    return f"{pool.name}-router"


def workers_network_policy(
    pool: PoolRef, scrapers: MetricsScrapers = NO_SCRAPERS
) -> dict[str, Json]:
    own_workers = {
        "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"}}
    }
    own_router = {
        "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "router"}}
    }
    gateways = {"podSelector": {"matchLabels": {fronts_label(pool.name): "true"}}}
    grpc = {"protocol": "TCP", "port": WORKER_GRPC_PORT}
    ingress: list[Json] = [
        # The pool's workers, on every port: the KV port, and the gloo/NCCL transports'
        # ports, which the OS picks.
        {"from": [own_workers]},
        # The pool's router (generation, KV events, health) and the routers of
        # InferenceGateways whose models target the pool: gRPC only.
        {"from": [own_router, gateways], "ports": [grpc]},
    ]
    metrics = scrapers.ingress_rule(WORKER_METRICS_PORT)
    if metrics is not None:
        ingress.append(metrics)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(pool, workers_network_policy_name(pool), "worker", "workers"),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_POOL: pool.name, LABEL_COMPONENT: "worker"}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def router_network_policy(
    pool: PoolRef, scrapers: MetricsScrapers = NO_SCRAPERS
) -> dict[str, Json]:
    return router_ingress_policy(
        metadata(pool, router_network_policy_name(pool), "router", "router"),
        {LABEL_POOL: pool.name, LABEL_COMPONENT: "router"},
        scrapers,
    )


def router_ingress_policy(
    meta: dict[str, Json], select: dict[str, str], scrapers: MetricsScrapers
) -> dict[str, Json]:
    """Routers (a pool's or an InferenceGateway's) take requests from anywhere and
    scrapes from ``scrapers``, nothing else."""
    # Tenants, through the gateway Service (authenticated by the router).
    ingress: list[Json] = [{"ports": [{"protocol": "TCP", "port": ROUTER_HTTP_PORT}]}]
    metrics = scrapers.ingress_rule(ROUTER_METRICS_PORT)
    if metrics is not None:
        ingress.append(metrics)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": dict(select)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
