"""Run a ladder of load points in wall time against an endpoint, one after the other.

Each load point gets its own content namespace (``r0``, ``r1``...): the same workload
shape with new text, so one point does not warm the server's cache for the next, and the
same seed gives the same requests and arrivals on every run.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from kvflow.loadgen.arrivals import (
    ArrivalKind,
    LoadPoint,
    mean_rate_per_s,
    poisson_offsets_s,
    trace_offsets_s,
)
from kvflow.loadgen.client import BenchClient
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.progress import Progress
from kvflow.loadgen.runner import run_closed_loop, run_open_loop
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits, summarize
from kvflow.loadgen.workload import BenchRequest, Workload


@dataclass(frozen=True)
class LadderPlan:
    workload: Workload
    points: Sequence[LoadPoint]
    seed: int
    warmup_s: float
    duration_s: float | None  # None: a trace's whole length (open loop only)
    max_requests: int | None
    slo: Slo
    limits: ScheduleLimits
    block_size: int


@dataclass(frozen=True)
class OpenLoopSchedule:
    requests: list[BenchRequest]
    offsets_s: list[float]
    offered_rate_per_s: float


def open_loop_schedule(plan: LadderPlan, point: LoadPoint, index: int) -> OpenLoopSchedule:
    """The requests and their send times for an open-loop point. Pure and seeded."""
    namespace = f"r{index}"
    requests = plan.workload.requests(seed=plan.seed, namespace=namespace)
    horizon_s = None if plan.duration_s is None else plan.warmup_s + plan.duration_s
    if point.kind is ArrivalKind.POISSON:
        assert horizon_s is not None, "a Poisson ladder needs a duration"
        rng = random.Random(f"{plan.seed}/{namespace}/arrivals")
        offsets = poisson_offsets_s(point.value, horizon_s, rng)
    else:
        assert point.kind is ArrivalKind.TRACE
        listed = list(requests)
        trace_times = [r.trace_offset_s for r in listed]
        if any(t is None for t in trace_times):
            raise ValueError(f"{plan.workload.name} has no arrival times to replay")
        offsets = trace_offsets_s([t or 0.0 for t in trace_times], point.value, horizon_s)
        requests = iter(listed)
    chosen = list(itertools.islice(requests, len(offsets)))
    if plan.max_requests is not None:
        chosen = chosen[: plan.max_requests]
    offsets = offsets[: len(chosen)]
    # A trace offers the rate of the part replayed, after any cut.
    offered = point.value if point.kind is ArrivalKind.POISSON else mean_rate_per_s(offsets)
    return OpenLoopSchedule(chosen, offsets, offered)


async def run_point(
    client: BenchClient, plan: LadderPlan, point: LoadPoint, index: int, out: TextIO | None
) -> LoadPointSummary:
    if point.kind is ArrivalKind.CLOSED:
        duration_s = plan.duration_s if plan.duration_s is not None else 0.0
        stop_after_s = plan.warmup_s + duration_s
        requests = plan.workload.requests(seed=plan.seed, namespace=f"r{index}")
        if plan.max_requests is not None:
            requests = itertools.islice(requests, plan.max_requests)
        progress = Progress(point.label, stop_after_s, plan.max_requests, out)
        records = await run_closed_loop(client, requests, point.num_users, stop_after_s, progress)
        offered = None
        closed_window_s: tuple[float, float] | None = (plan.warmup_s, stop_after_s)
    else:
        schedule = open_loop_schedule(plan, point, index)
        planned_s = schedule.offsets_s[-1] if schedule.offsets_s else 0.0
        progress = Progress(point.label, planned_s, len(schedule.requests), out)
        records = await run_open_loop(client, schedule.requests, schedule.offsets_s, progress)
        offered = schedule.offered_rate_per_s
        closed_window_s = None
    return summarize(
        point,
        records,
        warmup_s=plan.warmup_s,
        offered_rate_per_s=offered,
        slo=plan.slo,
        limits=plan.limits,
        block_size=plan.block_size,
        closed_window_s=closed_window_s,
    )


async def run_ladder(
    client: BenchClient, plan: LadderPlan, out: TextIO | None
) -> list[LoadPointSummary]:
    return [await run_point(client, plan, p, i, out) for i, p in enumerate(plan.points)]
