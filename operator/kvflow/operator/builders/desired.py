"""Everything a pool should own, as API objects (pure): the builders' single entry point."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import (
    Images,
    PoolRef,
    WorkerRole,
    router_name,
    worker_deployment_name,
    worker_roles,
)
from kvflow.operator.builders.network import (
    NO_SCRAPERS,
    MetricsScrapers,
    router_network_policy,
    workers_network_policy,
)
from kvflow.operator.builders.replicas import applied_replicas
from kvflow.operator.builders.router import router_configmap, router_deployment
from kvflow.operator.builders.services import disruption_budget, gateway_service, workers_service
from kvflow.operator.builders.workers import worker_deployment


@dataclass(frozen=True)
class ChildKey:
    """How the operator identifies a child: (apiVersion, kind, name) in the pool's namespace."""

    api_version: str
    kind: str
    name: str

    @staticmethod
    def of(obj: dict[str, Json]) -> ChildKey:
        return ChildKey(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


# Kinds a pool owns, in the order they are applied: config and Services before the
# Deployments that use them, budgets last.
OWNED_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def desired_children(
    pool: PoolRef,
    spec: v1alpha1.InferencePoolSpec,
    images: Images,
    replicas: Mapping[WorkerRole, int | None] | None = None,
    scrapers: MetricsScrapers = NO_SCRAPERS,
) -> list[dict[str, Json]]:
    """The pool's children in apply order; each is complete (server-side apply sends it as
    is). `replicas` per worker role (`replicas.applied_replicas`; None for a role: its
    Deployment carries no replica count); unset: each role's spec.replicas, or none for
    roles scaled by an external autoscaler. `scrapers`: who may reach the metrics ports
    (network.py)."""
    roles = worker_roles(spec)
    if replicas is None:
        replicas = applied_replicas(spec, {})
    children: list[dict[str, Json]] = [
        router_configmap(pool, spec),
        workers_service(pool),
        gateway_service(pool, spec.router),
    ]
    children += [
        worker_deployment(pool, spec, role, rs, images, replicas[role]) for role, rs in roles
    ]
    children.append(router_deployment(pool, spec, images))
    children += [
        disruption_budget(pool, worker_deployment_name(pool, role), role) for role, _ in roles
    ]
    children.append(disruption_budget(pool, router_name(pool), "router"))
    children.append(workers_network_policy(pool, scrapers))
    children.append(router_network_policy(pool, scrapers))
    return children


def deployment_roles(pool: PoolRef, spec: v1alpha1.InferencePoolSpec) -> dict[str, str]:
    """Deployment name -> role, for reading status back from observed Deployments."""
    out: dict[str, str] = {
        worker_deployment_name(pool, role): role for role, _ in worker_roles(spec)
    }
    out[router_name(pool)] = "router"
    return out
