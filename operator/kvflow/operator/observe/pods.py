"""A pool's pods, as the planner counts them, and where their metrics are (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_ROLE,
    ROUTER_METRICS_PORT,
    WORKER_METRICS_PORT,
)


@dataclass(frozen=True)
class RolePods:
    """One role's pods now; `targets` are the ready pods' /metrics URLs."""

    ready_replicas: int = 0
    pending_replicas: int = 0
    unschedulable_replicas: int = 0
    targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolPods:
    roles: dict[str, RolePods] = field(default_factory=dict)  # colocated, prefill, decode
    router_targets: tuple[str, ...] = ()  # the pool's own routers
    # The routers of InferenceGateways that front the pool: they report every pool they
    # front, so the planner reads only this pool's series of them (observation.gateway_match).
    gateway_targets: tuple[str, ...] = ()


def _condition(pod: Mapping[str, Json], type_: str) -> Mapping[str, Json]:
    conditions = (pod.get("status") or {}).get("conditions") or []
    found: Mapping[str, Json] = next((c for c in conditions if c.get("type") == type_), {})
    return found


def metrics_url(ip: str, port: int) -> str:
    host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod address
    return f"http://{host}:{port}/metrics"


def classify(
    pods: Iterable[Mapping[str, Json]], gateways: Iterable[Mapping[str, Json]] = ()
) -> PoolPods:
    """Ready, pending and unschedulable pods per worker role; terminating pods are gone
    already as far as capacity goes, and are not counted. ``gateways``: the pods of the
    InferenceGateways that front the pool (labelled ``fronts.kvflow.io/<pool>``)."""
    counts: dict[str, list[int]] = {}
    targets: dict[str, list[str]] = {}
    routers: list[str] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        labels = meta.get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP") or ""
        ready = _condition(pod, "Ready").get("status") == "True"
        if labels.get(LABEL_COMPONENT) == "router":
            if ready and ip:
                routers.append(metrics_url(ip, ROUTER_METRICS_PORT))
            continue
        role = labels.get(LABEL_ROLE)
        if labels.get(LABEL_COMPONENT) != "worker" or not role:
            continue
        ready_n, pending_n, unschedulable_n = counts.setdefault(role, [0, 0, 0])
        scheduled = _condition(pod, "PodScheduled")
        if ready:
            ready_n += 1
            if ip:
                targets.setdefault(role, []).append(metrics_url(ip, WORKER_METRICS_PORT))
        else:
            pending_n += 1
            if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
                unschedulable_n += 1
        counts[role] = [ready_n, pending_n, unschedulable_n]
    return PoolPods(
        roles={
            role: RolePods(c[0], c[1], c[2], tuple(sorted(targets.get(role, ()))))
            for role, c in counts.items()
        },
        router_targets=tuple(sorted(routers)),
        gateway_targets=tuple(sorted(_ready_routers(gateways))),
    )


def _ready_routers(pods: Iterable[Mapping[str, Json]]) -> list[str]:
    urls = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP") or ""
        ready = _condition(pod, "Ready").get("status") == "True"
        is_router = (meta.get("labels") or {}).get(LABEL_COMPONENT) == "router"
        if is_router and ready and ip and not meta.get("deletionTimestamp"):
            urls.append(metrics_url(ip, ROUTER_METRICS_PORT))
    return urls
