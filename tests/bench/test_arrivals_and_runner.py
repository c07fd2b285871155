"""Arrival schedules, and the open-loop runner keeping its schedule against a slow server."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random

import pytest

from kvflow.loadgen.arrivals import (
    ArrivalKind,
    LoadPoint,
    mean_rate_per_s,
    poisson_offsets_s,
    trace_offsets_s,
)
from kvflow.loadgen.client import BenchClient, Clock
from kvflow.loadgen.ladder import LadderPlan, open_loop_schedule
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.no_reuse import NoReuseWorkload
from kvflow.loadgen.payloads import EndpointConfig
from kvflow.loadgen.progress import Progress
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.runner import run_closed_loop, run_open_loop
from kvflow.loadgen.summary import ScheduleLimits
from kvflow.loadgen.trace import TraceRecord
from kvflow.loadgen.trace_replay import TraceWorkload
from kvflow.loadgen.workload import Workload


def test_poisson_schedule_is_seeded_and_has_its_rate() -> None:
    a = poisson_offsets_s(50.0, 100.0, random.Random("s"))
    assert a == poisson_offsets_s(50.0, 100.0, random.Random("s"))
    assert a != poisson_offsets_s(50.0, 100.0, random.Random("t"))
    assert all(0 <= x < 100 for x in a) and a == sorted(a)
    # 5,000 expected arrivals: the count's standard deviation is sqrt(5000) ~ 71.
    assert abs(len(a) - 5000) < 5 * 71
    gaps = [b - x for x, b in itertools.pairwise(a)]
    cv = (sum((g - 0.02) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.02
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_offsets_s(0.0, 1.0, random.Random())


def test_trace_schedule_speeds_up_and_cuts() -> None:
    assert trace_offsets_s([0.0, 1.0, 3.0, 8.0], 2.0) == [0.0, 0.5, 1.5, 4.0]
    assert trace_offsets_s([0.0, 1.0, 3.0, 8.0], 2.0, horizon_s=2.0) == [0.0, 0.5, 1.5]
    assert mean_rate_per_s([0.0, 0.5, 1.5, 4.0]) == pytest.approx(0.75)


class SlowServer(BenchClient):
    """Answers every request after ``latency_s``, however many are in flight; no network."""

    def __init__(self, latency_s: float) -> None:
        self.config = EndpointConfig("http://unused/v1", "m")
        self.latency_s = latency_s

    async def send(self, request_id: str, body: bytes, *, scheduled_s: float | None,
                   now: Clock) -> RequestRecord:  # fmt: skip
        sent_s = now()
        await asyncio.sleep(self.latency_s)
        return RequestRecord(request_id, scheduled_s, sent_s, now(), (now(),), 1)


def test_open_loop_sends_on_schedule_however_slow_the_answers() -> None:
    # 10 requests 50 ms apart, each answered after 1 s: a generator that waited for answers
    # (coordinated omission) would send them 1 s apart.
    requests = list(itertools.islice(NoReuseWorkload(8).requests(seed=0, namespace="x"), 10))
    offsets = [0.05 * i for i in range(10)]
    progress = Progress("test", 0.5, 10, None)
    records = asyncio.run(run_open_loop(SlowServer(1.0), requests, offsets, progress))
    assert [r.request_id for r in records] == [r.request_id for r in requests]
    lags = [r.schedule_lag_s or 0.0 for r in records]
    # Waiting for answers would make the last send 9 s late; keeping the schedule leaves
    # only event-loop delays (milliseconds; 0.5 s of slack for a loaded 2-core machine).
    assert max(lags) < 0.5, lags
    assert all(r.end_s - r.sent_s >= 1.0 for r in records)
    assert progress.num_sent == progress.num_done == 10


def test_closed_loop_users_wait_for_their_answers() -> None:
    requests = itertools.islice(NoReuseWorkload(8).requests(seed=0, namespace="x"), 6)
    progress = Progress("test", 60.0, 6, None)
    records = asyncio.run(run_closed_loop(SlowServer(0.2), requests, 2, 60.0, progress))
    assert len(records) == 6  # the supply ran out before the time did
    assert all(r.scheduled_s is None for r in records)
    # Two users: never more than two requests in flight, so the third send waits for the
    # first answer (0.2 s) and so on.
    sends = sorted(r.sent_s for r in records)
    for i in range(2, 6):
        assert sends[i] - sends[i - 2] >= 0.2 - 1e-3
    for r in records:
        assert sum(o.sent_s <= r.sent_s < o.end_s for o in records) <= 2


def plan(workload: Workload, **changes: object) -> LadderPlan:
    base = LadderPlan(workload=workload, points=(), seed=3, warmup_s=1.0, duration_s=4.0,
                      max_requests=None, slo=Slo(1.0, 0.1), limits=ScheduleLimits(),
                      block_size=16)  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_open_loop_schedule_per_rung() -> None:
    p = plan(NoReuseWorkload(8))
    poisson = LoadPoint(ArrivalKind.POISSON, 10.0)
    first = open_loop_schedule(p, poisson, 0)
    assert first == open_loop_schedule(p, poisson, 0)  # seeded
    assert 20 < len(first.requests) == len(first.offsets_s) < 80  # about 10/s over 5 s
    assert max(first.offsets_s) < 5.0 and first.offered_rate_per_s == 10.0
    assert open_loop_schedule(p, poisson, 1).offsets_s != first.offsets_s  # another rung
    capped = open_loop_schedule(plan(NoReuseWorkload(8), max_requests=5), poisson, 0)
    assert capped.offsets_s == first.offsets_s[:5] and len(capped.requests) == 5

    records = [TraceRecord(1000.0 * i, 600, 4, (0, 1)) for i in range(12)]
    trace = plan(TraceWorkload(records), warmup_s=0.0, duration_s=None)
    whole = open_loop_schedule(trace, LoadPoint(ArrivalKind.TRACE, 2.0), 0)
    assert whole.offsets_s == [0.5 * i for i in range(12)]  # 1 s apart, twice as fast
    assert whole.offered_rate_per_s == pytest.approx(2.0)
    cut = open_loop_schedule(dataclasses.replace(trace, duration_s=2.0),
                             LoadPoint(ArrivalKind.TRACE, 2.0), 0)  # fmt: skip
    assert cut.offsets_s == [0.0, 0.5, 1.0, 1.5]
