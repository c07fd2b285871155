"""Ladders for virtual-time runs: a workload, its load points, and how each is measured.

A Poisson point measures a fixed number of requests after a fixed number of warm-up
requests, whatever its rate (``warmup_s = warmup_requests / rate``): every rung then starts
from caches warmed by the same traffic, and costs the simulator the same. A trace replays
whole, its first ``warmup_s`` of schedule unmeasured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.ladder import LadderPlan
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits
from kvflow.loadgen.workload import Workload
from kvflow.sim.arms import Arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.run import PointResult, run_point


@dataclass(frozen=True)
class SimLadder:
    name: str
    workload: Workload
    points: Sequence[LoadPoint]
    slo: Slo
    seed: int = 0
    warmup_requests: int = 400  # Poisson points
    measured_requests: int = 600
    trace_warmup_s: float = 60.0  # trace points

    def plan_for(self, point: LoadPoint) -> LadderPlan:
        if point.kind is ArrivalKind.POISSON:
            warmup_s = self.warmup_requests / point.value
            duration_s: float | None = self.measured_requests / point.value
        elif point.kind is ArrivalKind.TRACE:
            warmup_s, duration_s = self.trace_warmup_s / point.value, None
        else:
            raise ValueError("virtual time runs open-loop points only (Poisson or a trace)")
        return LadderPlan(
            workload=self.workload,
            points=self.points,
            seed=self.seed,
            warmup_s=warmup_s,
            duration_s=duration_s,
            max_requests=None,
            slo=self.slo,
            # Virtual time sends every request exactly on schedule.
            limits=ScheduleLimits(),
            block_size=16,
        )


Progress = Callable[[str, str, LoadPointSummary, float], None]


def run_ladder(
    spec: ClusterSpec, arm: Arm, ladder: SimLadder, on_point: Progress | None = None
) -> list[PointResult]:
    results = []
    for index, point in enumerate(ladder.points):
        started_s = time.perf_counter()
        result = run_point(spec, arm, ladder.plan_for(point), point, index)
        if on_point is not None:
            on_point(ladder.name, arm.name, result.summary, time.perf_counter() - started_s)
        results.append(result)
    return results
