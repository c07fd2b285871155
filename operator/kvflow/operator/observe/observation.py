"""One role's `Observation` from its pods' metrics over one window (pure).

Sources, by what tenants feel first:

- TTFT, for roles that prefill (colocated, prefill): the routers' histogram (arrival at
  the gateway to the first token, what a tenant sees, queueing and KV transfer included);
  the role's own workers' when no router was read.
- TPOT, for roles that decode (colocated, decode): the role's workers' histogram (the
  steps they run, unaffected by the other role); the routers' when no worker was read.
- Load (requests, prompt and output tokens per request), queue wait, batch size and KV
  usage: the role's own workers. Requests the routers' admission control refused
  (`kvflow_router_admission_rejections_total`) are demand the workers never saw: a role
  that prefills adds them to its request rate and counts them as over the TTFT target.
  Counters and histograms are what happened in the window;
  gauges are the latest read, averaged over the ready replicas read.

Every family counts the online classes only (realtime, normal): the batch class's series,
workers' and routers', are left out at the read (`OFFLINE_SERIES`), so a batch alone never
asks for a replica; it fills spare capacity and is preempted first (docs/planner.md,
"Batch work"). KV usage is the share of blocks the online classes hold where the worker
exports it by class, else the whole cache's fill.

A metric nobody reported is None, never 0 (the model says which inputs it lacked);
a window with no finished request has a rate of 0 and no means.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.operator.observe.exposition import Histogram, Metrics
from kvflow.operator.observe.histograms import mean, quantile, share_above, total
from kvflow.operator.observe.pods import RolePods
from kvflow.operator.planner.types import Observation, WorkerRole
from kvflow.proto.metric_names import (
    CLASS_LABEL,
    ROUTER_SHED,
    ROUTER_TPOT,
    ROUTER_TTFT,
    WORKER_FINISHED,
    WORKER_GENERATION_TOKENS,
    WORKER_KV_CLASS_USAGE,
    WORKER_KV_USAGE,
    WORKER_PROMPT_TOKENS,
    WORKER_QUEUE_WAIT,
    WORKER_RUNNING,
    WORKER_TPOT,
    WORKER_TTFT,
    WORKER_WAITING,
)
from kvflow.proto.priority_class import PriorityClass
from kvflow.proto.roles import Role

WORKER_FAMILIES = frozenset(
    {
        WORKER_TTFT, WORKER_TPOT, WORKER_QUEUE_WAIT, WORKER_FINISHED, WORKER_PROMPT_TOKENS,
        WORKER_GENERATION_TOKENS, WORKER_RUNNING, WORKER_WAITING, WORKER_KV_USAGE,
        WORKER_KV_CLASS_USAGE,
    }
)  # fmt: skip
# What of a worker's or router's exposition the planner leaves out (exposition.parse's
# ``drop``): the offline class's series. Prometheus' side is promql.pool_query's selector.
OFFLINE_SERIES = {CLASS_LABEL: PriorityClass.BATCH.value}
ROUTER_FAMILIES = frozenset({ROUTER_TTFT, ROUTER_TPOT, ROUTER_SHED})


def gateway_match(pool: str, served_model_name: str) -> dict[str, dict[str, str]]:
    """What of an InferenceGateway's routers is one pool's (exposition.parse's ``match``):
    its refusals by the `pool` label, its latencies by the `model` label (the served name
    that answered, unique among the gateway's pools)."""
    return {
        ROUTER_SHED: {"pool": pool},
        ROUTER_TTFT: {"model": served_model_name},
        ROUTER_TPOT: {"model": served_model_name},
    }


@dataclass(frozen=True)
class Targets:
    """A role's metrics over one window: one `Metrics` per worker read, and the routers'."""

    workers: Sequence[Metrics]
    routers: Sequence[Metrics]
    # This role's ready workers without a window this interval.
    num_unread: int = 0


@dataclass(frozen=True)
class Slo:
    ttft_target_s: float
    tpot_target_s: float
    percentile: float  # 90 means p90


def prefills(role: WorkerRole) -> bool:
    return Role(role).prefills


def decodes(role: WorkerRole) -> bool:
    return Role(role).decodes


def observe_role(
    role: WorkerRole,
    *,
    time_s: float,
    window_s: float,
    desired_replicas: int,
    pods: RolePods,
    targets: Targets,
    slo: Slo,
) -> Observation:
    workers, routers = targets.workers, targets.routers
    q = slo.percentile / 100
    ttft = tpot = None
    if prefills(role):
        ttft = _first_counted(_total(routers, ROUTER_TTFT), _total(workers, WORKER_TTFT))
    if decodes(role):
        tpot = _first_counted(_total(workers, WORKER_TPOT), _total(routers, ROUTER_TPOT))
    # Workers not read this interval are taken to carry what the read ones carry: their
    # share of the counts is not zero (a pool sized on the read ones' load alone shrank to
    # a quarter with three of four scrapes timing out). The planner holds a scale-down
    # while fewer than half were read (planner/signals.py).
    scale = (len(workers) + targets.num_unread) / len(workers) if workers else 1.0
    finished = _scaled(_sum(workers, WORKER_FINISHED), scale)
    prompt_tokens = _scaled(_sum(workers, WORKER_PROMPT_TOKENS), scale)
    generated = _scaled(_sum(workers, WORKER_GENERATION_TOKENS), scale)
    per_request = finished is not None and finished > 0
    shed = _sum(routers, ROUTER_SHED) if prefills(role) else None
    # With no worker read (none up: scaled to zero) the routers' refusals are the demand.
    came = None if finished is None and shed is None else (finished or 0.0) + (shed or 0.0)
    return Observation(
        time_s=time_s,
        desired_replicas=desired_replicas,
        ready_replicas=pods.ready_replicas,
        pending_replicas=pods.pending_replicas,
        unschedulable_replicas=pods.unschedulable_replicas,
        request_rate_per_s=None if came is None else came / window_s,
        mean_input_tokens=_ratio(prompt_tokens, finished) if per_request else None,
        mean_output_tokens=_ratio(generated, finished) if per_request else None,
        ttft_s=quantile(ttft, q),
        tpot_s=quantile(tpot, q),
        ttft_violation_fraction=_with_shed(share_above(ttft, slo.ttft_target_s), ttft, shed),
        tpot_violation_fraction=share_above(tpot, slo.tpot_target_s),
        prefill_queue_wait_s=mean(_total(workers, WORKER_QUEUE_WAIT)) if prefills(role) else None,
        decode_batch_size=_mean_gauge(workers, WORKER_RUNNING) if decodes(role) else None,
        kv_usage=_kv_usage(workers),
        # The planner's Backlog rule sizes for draining this queue (planner/signals.py).
        num_waiting_requests=_scaled(_sum_gauge(workers, WORKER_WAITING), scale),
        shed_fraction=None if shed is None or not came else shed / came,
        num_unread_workers=targets.num_unread,
        num_running_requests=_scaled(_sum_gauge(workers, WORKER_RUNNING), scale),
    )


def _with_shed(share: float | None, ttft: Histogram | None, shed: float | None) -> float | None:
    """The share over the TTFT target among the served and the refused together."""
    if not shed:
        return share
    served = ttft.count if ttft is not None else 0.0
    return ((share or 0.0) * served + shed) / (served + shed)


def _total(sources: Sequence[Metrics], family: str) -> Histogram | None:
    return total(m.histograms[family] for m in sources if family in m.histograms)


def _first_counted(*candidates: Histogram | None) -> Histogram | None:
    """The first histogram that counted something in the window (else the first read)."""
    counted = [h for h in candidates if h is not None and h.count > 0]
    return counted[0] if counted else next((h for h in candidates if h is not None), None)


def _sum(sources: Sequence[Metrics], family: str) -> float | None:
    values = [m.counters[family] for m in sources if family in m.counters]
    return sum(values) if values else None


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _sum_gauge(sources: Sequence[Metrics], family: str) -> float | None:
    values = [m.gauges[family] for m in sources if family in m.gauges]
    return sum(values) if values else None


def _kv_usage(workers: Sequence[Metrics]) -> float | None:
    """Mean over the workers read of the online classes' share of the cache (the whole
    cache's fill for a worker that does not export it by class)."""
    values = [
        m.gauges[WORKER_KV_CLASS_USAGE if WORKER_KV_CLASS_USAGE in m.gauges else WORKER_KV_USAGE]
        for m in workers
        if WORKER_KV_CLASS_USAGE in m.gauges or WORKER_KV_USAGE in m.gauges
    ]
    return sum(values) / len(values) if values else None


def _mean_gauge(sources: Sequence[Metrics], family: str) -> float | None:
    values = [m.gauges[family] for m in sources if family in m.gauges]
    return sum(values) / len(values) if values else None
