"""The arms of the planner benchmark: who decides the replicas of the one colocated role.

- **planner**: kvflow's SLO planner model (`kvflow.operator.planner.plan`), fed what the
  operator's scrape would give, with the capacity profile derived from the workers' own
  step-time profile (`capacity_from_timing`).
- **static-peak** / **static-mean**: a fixed count sized, with the same capacity profile
  and the planner's 80 % target utilisation, for the traffic's peak or mean rate.
- **reactive**: a HorizontalPodAutoscaler on the workers' queue length and KV usage, with
  HPA's defaults: desired = ceil(ready x metric / target) for each metric, the larger one,
  a 10 % tolerance, a 15 s sync period, scale-up at once (at most doubling, or +4), and a
  300 s scale-down stabilization window (the most replicas recommended over it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.operator.planner import (
    CapacityProfile,
    Observation,
    PlannerConfig,
    PlannerState,
    RoleConfig,
    Tuning,
    plan,
)


@dataclass(frozen=True)
class PoolSample:
    """One scrape of the pool: the planner's Observation plus the raw queue figures."""

    observation: Observation
    num_waiting_per_replica: float | None  # requests queued per ready worker, now
    kv_usage: float | None  # mean KV fill of the ready workers, now


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def interval_s(self) -> float: ...

    def initial_replicas(self) -> int: ...

    def decide(self, sample: PoolSample) -> tuple[int, str]:
        """Replicas for the role, and a short reason."""
        ...


@dataclass
class Static:
    name: str
    replicas: int
    interval_s: float = 30.0

    def initial_replicas(self) -> int:
        return self.replicas

    def decide(self, sample: PoolSample) -> tuple[int, str]:
        return self.replicas, "Static"


@dataclass
class Planner:
    config: PlannerConfig
    name: str = "planner"
    state: PlannerState = field(default_factory=PlannerState)

    @property
    def interval_s(self) -> float:
        return self.config.interval_s

    def initial_replicas(self) -> int:
        return self.config.roles["colocated"].spec_replicas

    def decide(self, sample: PoolSample) -> tuple[int, str]:
        result = plan(self.config, {"colocated": sample.observation}, self.state)
        self.state = result.state
        decision = result.decision("colocated")
        assert decision is not None
        return decision.replicas, decision.reason


@dataclass
class Reactive:
    """HPA on the queue length per replica and the KV usage (module docstring)."""

    min_replicas: int
    max_replicas: int
    initial: int
    queue_target: float = 2.0  # waiting requests per ready worker
    kv_target: float = 0.7
    tolerance: float = 0.1
    stabilization_s: float = 300.0
    interval_s: float = 15.0
    name: str = "reactive"
    _recommendations: list[tuple[float, int]] = field(default_factory=list)

    def initial_replicas(self) -> int:
        return self.initial

    def decide(self, sample: PoolSample) -> tuple[int, str]:
        obs = sample.observation
        now = obs.time_s
        current = obs.desired_replicas
        ready = max(obs.ready_replicas, 1)
        ratios = []
        if sample.num_waiting_per_replica is not None:
            ratios.append(("QueueLength", sample.num_waiting_per_replica / self.queue_target))
        if sample.kv_usage is not None:
            ratios.append(("KvUsage", sample.kv_usage / self.kv_target))
        if not ratios:
            return current, "MetricsMissing"
        reason, ratio = max(ratios, key=lambda r: r[1])
        want = current if abs(ratio - 1) <= self.tolerance else math.ceil(ready * ratio)
        want = max(self.min_replicas, min(self.max_replicas, want))
        self._recommendations = [
            (t, r) for t, r in self._recommendations if t >= now - self.stabilization_s
        ]
        self._recommendations.append((now, want))
        if want > current:
            return min(want, max(2 * current, current + 4)), reason
        stable = max(r for _, r in self._recommendations)
        return min(stable, current), "Stabilizing" if stable >= current else "Underloaded"


def planner_config(
    *,
    capacity: CapacityProfile,
    min_replicas: int,
    max_replicas: int,
    initial: int,
    ttft_target_s: float,
    tpot_target_s: float,
    percentile: float,
    startup_s: float,
    interval_s: float = 30.0,
    tuning: Tuning | None = None,
    scale_down_stabilization_s: float = 300.0,
) -> PlannerConfig:
    role = RoleConfig(
        spec_replicas=initial,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        capacity=capacity,
    )
    return PlannerConfig(
        roles={"colocated": role},
        ttft_target_s=ttft_target_s,
        tpot_target_s=tpot_target_s,
        percentile=percentile,
        interval_s=interval_s,
        scale_down_stabilization_s=scale_down_stabilization_s,
        # The benchmark's startup delay is what the pool's replicaStartupSeconds would say.
        replica_startup_s=startup_s,
        tuning=tuning if tuning is not None else Tuning(),
    )
