"""Run one load point of a workload on a fresh virtual cluster, for one arm.

The schedule is the wall-time bench's own (``ladder.open_loop_schedule``: the same
requests and arrival times for the same seed), and the records go through the same
``summarize``; only the clock differs. Each load point starts from cold caches, like each
rung of a wall-time ladder (which gets new text for that reason).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.loadgen.arrivals import LoadPoint
from kvflow.loadgen.ladder import LadderPlan, open_loop_schedule
from kvflow.loadgen.metrics import is_measured
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import LoadPointSummary, summarize
from kvflow.sim.arms import Arm
from kvflow.sim.cluster import ClusterSpec, VirtualCluster, WorkerStats


@dataclass(frozen=True)
class PointResult:
    arm: str
    summary: LoadPointSummary
    workers: list[WorkerStats]
    records: list[RequestRecord]
    # The measured requests' TTFT floors' P90 (floor.py): no router's TTFT P90 is lower.
    floor_ttft_p90_s: float | None = None


def run_point(
    spec: ClusterSpec, arm: Arm, plan: LadderPlan, point: LoadPoint, index: int
) -> PointResult:
    schedule = open_loop_schedule(plan, point, index)
    cluster = VirtualCluster(spec, arm, seed=plan.seed)
    for request, offset_s in zip(schedule.requests, schedule.offsets_s, strict=True):
        cluster.submit(request, offset_s)
    records = cluster.run()
    summary = summarize(
        point,
        records,
        warmup_s=plan.warmup_s,
        offered_rate_per_s=schedule.offered_rate_per_s,
        slo=plan.slo,
        limits=plan.limits,
        block_size=spec.profile.block_size,
    )
    measured = [r.request_id for r in records if is_measured(r, plan.warmup_s)]
    return PointResult(arm.name, summary, cluster.worker_stats(), records,
                       cluster.floor.p90_s(measured))  # fmt: skip
