"""The SLO planner's periodic task: one interval per pool every autoscaling.intervalSeconds.

An interval counts the pool's pods, reads its workers' and routers' /metrics, turns what
happened since the previous read into one `Observation` per role (`observe/`), and hands
them to the model (`planner.model.plan`) under the pool's reconcile lock
(`Reconciler.record_plan`), which writes status (replicas per role, the decision and its
reason, SLOMet) and then applies the Deployments. Each change of replicas is an Event,
and every input and decision is a metric (`planner_metrics`).

Why not a kopf timer: kopf's timers and daemons always put a finalizer on the object they
run for, and this operator keeps no state on pools (a pool stays deletable with the
operator uninstalled; the operator has no patch right on pools). Like the drift sweep, this
loop runs only in the replica that holds the Lease.

Memory between intervals (the model's `PlannerState`, the previous reads) lives in this
process only. After a restart the first interval reads without deciding (counters since
each pod started are no window), and the model starts from `PlannerState()`; the replicas
it decided before survive in the pool's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvflow.operator.admin_policy import AdminPolicy, prometheus_refusal, prometheus_url_allowed
from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import Json, SchemaError, from_json
from kvflow.operator.builders.names import (
    LABEL_POOL,
    PoolRef,
    WorkerRole,
    fronts_label,
    pool_labels,
    worker_roles,
)
from kvflow.operator.kube import Kube, KubeError
from kvflow.operator.observe.exposition import ExpositionError, Metrics, parse, window
from kvflow.operator.observe.observation import (
    OFFLINE_SERIES,
    ROUTER_FAMILIES,
    WORKER_FAMILIES,
    Targets,
    gateway_match,
)
from kvflow.operator.observe.pods import PoolPods, classify
from kvflow.operator.observe.prometheus import PrometheusError, instant_query
from kvflow.operator.observe.promql import AnswerError, fold, pool_query
from kvflow.operator.observe.scrape import fetch_all
from kvflow.operator.planner.config import config_from_spec
from kvflow.operator.planner.model import plan
from kvflow.operator.planner.types import (
    Decision,
    Observation,
    PlannerConfig,
    PlannerState,
    SloVerdict,
)
from kvflow.operator.planner_metrics import PlannerMetrics
from kvflow.operator.planning_inputs import observations_of, scraped_targets
from kvflow.operator.reconcile import PlanOutcome, Reconciler

log = logging.getLogger(__name__)

# How often the loop looks for pools that are due: intervals run at most this late. The
# smallest intervalSeconds is 5; listing pools every 2 s is one cheap call.
TICK_S = 2.0
# Decisions that hold replicas although more are wanted, or with nothing to decide from: a
# Warning Event when one starts.
BLOCKED = ("PendingPods", "AtMaxReplicas", "PrometheusUnavailable", "PrometheusNotAllowed")

PoolKey = tuple[str, str]
HoldReason = Literal["PrometheusUnavailable", "PrometheusNotAllowed"]


@dataclass
class _Memory:
    state: PlannerState = field(default_factory=PlannerState)
    reads: dict[str, Metrics] = field(default_factory=dict)
    read_at_s: float | None = None
    due_s: float = 0.0
    reasons: dict[str, str] = field(default_factory=dict)  # role -> last decision's reason


class PlanningLoop:
    def __init__(
        self,
        kube: Kube,
        reconciler: Reconciler,
        metrics: PlannerMetrics,
        namespaces: list[str],
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
        policy: AdminPolicy | None = None,
    ) -> None:
        self.kube, self.reconciler, self.metrics = kube, reconciler, metrics
        self.policy = policy if policy is not None else reconciler.policy
        self.namespaces, self.clock, self.tick_s = namespaces, clock, tick_s
        self._memory: dict[PoolKey, _Memory] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except KubeError as exc:
                log.warning("planner: cannot list pools: %s", exc)
            except Exception:  # the planner goes on at the next tick, as after an outage
                log.exception("planner: this tick failed")

    async def tick(self) -> None:
        """Run every pool that is due."""
        bodies = await asyncio.to_thread(self.kube.list_pool_objects, self.namespaces)
        seen: set[PoolKey] = set()
        for body in bodies:
            key = (body["metadata"]["namespace"], body["metadata"]["name"])
            seen.add(key)
            spec = _spec(body)
            if spec is None or not spec.autoscaling.enabled:
                if self._memory.pop(key, None) is not None:  # re-enabled later: afresh
                    self.metrics.forget(*key)
                continue
            memory = self._memory.setdefault(key, _Memory())
            now_s = self.clock()
            if now_s < memory.due_s:
                continue
            memory.due_s = now_s + spec.autoscaling.interval_seconds
            try:
                await self._interval(body, spec, memory, now_s)
            except KubeError as exc:
                log.warning("planner: %s/%s: %s", key[0], key[1], exc)
            except Exception:  # one pool's fault never stops the others' planning
                log.exception("planner: %s/%s: this interval failed", key[0], key[1])
                self.metrics.interval_failures.labels(key[0], key[1]).inc()
        for gone in set(self._memory) - seen:
            del self._memory[gone]
            self.metrics.forget(*gone)

    async def _interval(
        self, body: Json, spec: v1alpha1.InferencePoolSpec, memory: _Memory, now_s: float
    ) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        pool = PoolRef(name=name, namespace=namespace, uid=meta["uid"])
        own = await asyncio.to_thread(self.kube.list_pods, namespace, {LABEL_POOL: name})
        gateways = await asyncio.to_thread(
            self.kube.list_pods, namespace, {fronts_label(name): "true"}
        )
        pods = classify(own, gateways)
        deployments = {
            obj["metadata"]["name"]: obj
            for obj in await asyncio.to_thread(
                self.kube.list_children, "Deployment", namespace, pool_labels(pool)
            )
        }
        source = spec.autoscaling.prometheus
        unavailable = ""  # why Prometheus gave no inputs: hold replicas, say so
        hold_reason: HoldReason = "PrometheusUnavailable"
        if source is not None and not prometheus_url_allowed(
            source.url, self.policy.allowed_prometheus_urls
        ):
            # Never sent: the operator queries only the Prometheus its administrator allows.
            unavailable = prometheus_refusal(source.url, self.policy)
            hold_reason = "PrometheusNotAllowed"
            targets, window_s = {}, float(spec.autoscaling.interval_seconds)
        elif source is not None:
            # Prometheus keeps the history: no first read to wait for. Going back to direct
            # scrapes later starts from a fresh first read.
            memory.reads, memory.read_at_s = {}, None
            window_s = float(source.window_seconds or spec.autoscaling.interval_seconds)
            try:
                targets = await query_targets(source.url, spec, pool, window_s, pods)
            except PrometheusError as exc:
                unavailable = str(exc)
                self.metrics.prometheus_failures.labels(namespace, name).inc()
                log.warning("planner: %s/%s: Prometheus: %s", namespace, name, exc)
                targets = {}
        else:
            reads = await self._read(namespace, name, pods, spec.model.served_name)
            previous, previous_at_s = memory.reads, memory.read_at_s
            memory.reads, memory.read_at_s = reads, now_s
            if previous_at_s is None:
                log.info("planner: %s/%s: first read; deciding from the next one", namespace, name)
                return
            # Only a target read now and at the last read has a window: one that missed a
            # read (timed out, not ready) gives its baseline now. Its counts since it
            # started, over one interval, read as a burst of all its life's traffic (a
            # steady pool went to maxReplicas).
            windows = {url: window(m, previous[url]) for url, m in reads.items()
                       if url in previous}  # fmt: skip
            targets = scraped_targets(spec, pods, windows)
            window_s = now_s - previous_at_s
        observations = observations_of(spec, pool, pods, deployments, targets, now_s, window_s)
        for role, obs in observations.items():
            if unavailable:
                self.metrics.unobserved(namespace, name, role)
            else:
                self.metrics.observed(namespace, name, role, obs)

        def decide(current: Json) -> PlanOutcome | None:
            current_spec = _spec(current)
            if current_spec is None or not current_spec.autoscaling.enabled:
                return None
            config = _config(current_spec)
            if unavailable:
                return _hold(config, observations, unavailable, hold_reason)
            result = plan(config, observations, memory.state)
            memory.state = result.state
            roles = tuple(role for role, rc in config.roles.items() if rc.is_autoscaled)
            scaled = tuple(d for d in result.decisions if d.role in roles)
            return PlanOutcome(decisions=scaled, scaled_roles=roles, slo=result.slo)

        outcome = await asyncio.to_thread(self.reconciler.record_plan, namespace, name, decide)
        if outcome is not None:
            self._report(body, outcome, memory)
        self.metrics.interval_s.labels(namespace, name).observe(self.clock() - now_s)

    async def _read(
        self, namespace: str, name: str, pods: PoolPods, served_model_name: str
    ) -> dict[str, Metrics]:
        reads, failures = await scrape(pods, name, served_model_name)
        if failures:
            self.metrics.scrape_failures.labels(namespace, name).inc(failures)
        return reads

    def _report(self, body: Json, outcome: PlanOutcome, memory: _Memory) -> None:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        self.metrics.judged(namespace, name, outcome.slo)
        for decision in outcome.decisions:
            self.metrics.decided(namespace, name, decision)
            event = _event(decision, memory.reasons.get(decision.role))
            if event is not None:
                self.reconciler.post_event(body, *event)
            memory.reasons[decision.role] = decision.reason


def _event(decision: Decision, last_reason: str | None) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event a decision deserves, if any."""
    text = f"{decision.role} {decision.previous_replicas} -> {decision.replicas}"
    if decision.is_change:
        up = decision.replicas > decision.previous_replicas
        return (
            "Normal",
            "ScaledUp" if up else "ScaledDown",
            f"{text}: {decision.reason}: {decision.message}",
        )
    if decision.reason in BLOCKED and decision.reason != last_reason:
        return ("Warning", decision.reason, f"{decision.role} held at {decision.replicas}: "
                f"{decision.message}")  # fmt: skip
    return None


def _spec(body: Json) -> v1alpha1.InferencePoolSpec | None:
    try:
        return from_json(v1alpha1.InferencePoolSpec, body.get("spec") or {})
    except SchemaError:
        return None  # reconcile reports it


def _config(spec: v1alpha1.InferencePoolSpec) -> PlannerConfig:
    """The model's config; roles an external autoscaler owns are not the planner's to move
    (they are still observed: the SLO verdict covers the whole pool)."""
    config = config_from_spec(spec)
    external = {role for role, rs in worker_roles(spec) if rs.external_autoscaler}
    roles = {
        role: dataclasses.replace(rc, is_autoscaled=False) if role in external else rc
        for role, rc in config.roles.items()
    }
    return dataclasses.replace(config, roles=roles)


async def scrape(
    pods: PoolPods, pool: str, served_model_name: str
) -> tuple[dict[str, Metrics], int]:
    """Read every ready worker's and router's /metrics once: the families the planner reads,
    by URL, and how many targets did not answer or answered no exposition. Of the
    gateways' routers only pool `pool`'s series count (observation.gateway_match)."""
    workers = [url for role in pods.roles.values() for url in role.targets]
    routers = [*pods.router_targets, *pods.gateway_targets]
    bodies = await fetch_all([*workers, *routers])
    reads: dict[str, Metrics] = {}
    failures = len(workers) + len(routers) - len(bodies)
    shared = gateway_match(pool, served_model_name)
    for url, text in bodies.items():
        families = ROUTER_FAMILIES if url in routers else WORKER_FAMILIES
        match = shared if url in pods.gateway_targets else None
        try:  # the batch class's series left out: the planner sizes for the online ones
            reads[url] = parse(text, families, match, OFFLINE_SERIES)
        except ExpositionError as exc:
            log.warning("planner: %s: %s", url, exc)
            failures += 1
    return reads, failures


async def query_targets(
    url: str,
    spec: v1alpha1.InferencePoolSpec,
    pool: PoolRef,
    window_s: float,
    pods: PoolPods,
) -> dict[WorkerRole, Targets]:
    """Each role's metrics over the last `window_s` from the Prometheus at `url`, per
    scraped target: what `scraped_targets` gives from direct scrapes."""
    namespace, name = pool.namespace, pool.name
    data = await instant_query(url, pool_query(namespace, name, window_s))
    try:
        series = fold(data)
    except AnswerError as exc:
        raise PrometheusError(f"{url}: {exc}") from exc
    ready = sum(role.ready_replicas for role in pods.roles.values())
    if ready and not series.workers:
        raise PrometheusError(
            f"{url} has no kvflow_worker series with namespace={namespace!r}, "
            f"pool={name!r} over the last {window_s:.0f} s while {ready} workers are "
            "ready: does it scrape them (the chart's PodMonitors, monitoring.podMonitor)?"
        )
    routers = list(series.routers.values())
    return {
        role: Targets(workers=list(series.workers.get(role, {}).values()), routers=routers)
        for role, _ in worker_roles(spec)
    }


def _hold(
    config: PlannerConfig,
    observations: dict[WorkerRole, Observation],
    why: str,
    reason: HoldReason = "PrometheusUnavailable",
) -> PlanOutcome:
    """No inputs this interval (Prometheus did not answer): every role the planner moves
    keeps the replicas its Deployment asks for, and status says why."""
    roles = tuple(role for role, rc in config.roles.items() if rc.is_autoscaled)
    message = f"cannot read the planner's inputs: {why}"
    decisions = tuple(
        Decision(
            role=role,
            replicas=obs.desired_replicas,
            previous_replicas=obs.desired_replicas,
            reason=reason,
            message=message,
        )
        for role, obs in observations.items()
        if role in roles
    )
    verdict = SloVerdict("Unknown", reason, message[:1024])
    return PlanOutcome(decisions=decisions, scaled_roles=roles, slo=verdict)
