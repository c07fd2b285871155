"""A day of online traffic with a large batch submitted at its peak, in virtual time: the
Batch API's runner (router batch/runner.py) played against real engines on the simulator's
clock.

The day is the planner benchmark's diurnal traffic compressed into ``traffic.duration_s``;
the batch's "24h" window is the same span. The runner keeps at most ``max_in_flight`` lines
running and starts one only while no worker reports requests waiting and, with
``tpot_headroom``, every worker's decode step with one more sequence stays within that
share of the online TPOT target (the shared rule, kvflow.router.batch.pacing), checking
every ``tick_s``, as the router's runner does on its poll. Run once with the batch and
once without, on the same seed, the online requests are the same, so their latencies
compare directly. Batch lines run at priority class batch, as the router's runner sends
them.

`run_planned_day` plays the same day on an elastic pool whose replicas the SLO planner
decides (autoscale.drive): the planner's metrics count the online classes only, so its
replicas over the day are the same with the batch as without it.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock
from kvflow.proto.priority_class import PriorityClass
from kvflow.router.batch.pacing import TpotHeadroom, WorkerLoad, may_start_line
from kvflow.sim.arms import resolve_arm
from kvflow.sim.autoscale import DecisionLog, ReplicaSample, Slo, drive
from kvflow.sim.autoscale_cluster import ElasticCluster
from kvflow.sim.autoscale_policies import Policy
from kvflow.sim.autoscale_traffic import Traffic, arrival_times_s, requests_for
from kvflow.sim.cluster import ClusterSpec, VirtualCluster, _InFlight

BATCH_PREFIX = "batch-"


@dataclass(frozen=True)
class BatchDay:
    traffic: Traffic  # the online day (diurnal)
    num_lines: int  # the batch's requests
    submitted_at_s: float  # when the batch is created: the day's peak
    window_s: float  # its "24h"
    max_in_flight: int = 4
    tick_s: float = 0.5  # how often the runner looks for spare capacity
    input_tokens: int = 256  # each line's prompt (words, about tokens) and output
    output_tokens: int = 64
    # The online TPOT the runner leaves alone (pacing.TpotHeadroom); None: it waits for
    # queues only.
    tpot_headroom: TpotHeadroom | None = None


@dataclass
class DayResult:
    online: list[RequestRecord]
    batch: list[RequestRecord]
    batch_done_s: float | None  # when its last line ended; None: not all did
    most_in_flight: int


def _is_batch(request: BenchRequest) -> bool:
    return request.request_id.startswith(BATCH_PREFIX)


def _class_of(request: BenchRequest) -> tuple[str | None, PriorityClass]:
    return None, PriorityClass.BATCH if _is_batch(request) else PriorityClass.NORMAL


class _BatchCluster(VirtualCluster):
    """Runs batch lines at class batch and tells the runner when one ends (the cluster's
    own end-of-request hooks, overridden: the simulator has no public ones)."""

    def __init__(self, spec: ClusterSpec, seed: int) -> None:
        super().__init__(spec, resolve_arm("kvflow"), seed=seed)
        self.runner: _Runner | None = None

    def _tenant_and_class(self, request: BenchRequest) -> tuple[str | None, PriorityClass]:
        return _class_of(request)

    def _finish(self, flight: _InFlight, out: RequestOutput, now_s: float) -> None:
        super()._finish(flight, out, now_s)
        if self.runner is not None and _is_batch(flight.request):
            self.runner.ended(now_s)

    def _fail(self, request: BenchRequest, now_s: float, kind: str, detail: str) -> None:
        super()._fail(request, now_s, kind, detail)
        if self.runner is not None and _is_batch(request):
            self.runner.ended(now_s)


class _ElasticBatchCluster(ElasticCluster):
    """`_BatchCluster` on a pool whose replicas come and go (the same three hooks)."""

    def __init__(self, spec: ClusterSpec, seed: int, startup_s: float) -> None:
        super().__init__(spec, resolve_arm("kvflow"), startup_s=startup_s, seed=seed)
        self.runner: _Runner | None = None

    def _tenant_and_class(self, request: BenchRequest) -> tuple[str | None, PriorityClass]:
        return _class_of(request)

    def _finish(self, flight: _InFlight, out: RequestOutput, now_s: float) -> None:
        super()._finish(flight, out, now_s)
        if self.runner is not None and _is_batch(flight.request):
            self.runner.ended(now_s)

    def _fail(self, request: BenchRequest, now_s: float, kind: str, detail: str) -> None:
        super()._fail(request, now_s, kind, detail)
        if self.runner is not None and _is_batch(request):
            self.runner.ended(now_s)


@dataclass
class _Runner:
    cluster: VirtualCluster
    day: BatchDay
    pending: collections.deque[BenchRequest]
    num_in_flight: int = 0
    most_in_flight: int = 0
    num_ended: int = 0
    last_end_s: float = 0.0

    def tick(self) -> None:
        events = self.cluster.events
        loads = [WorkerLoad(w.load.num_waiting, w.load.num_decode_seqs, w.load.num_kv_tokens)
                 for w in self.cluster.workers.values()]  # fmt: skip
        timing = self.cluster.spec.profile.timing
        if may_start_line(loads, timing, self.day.input_tokens, self.day.tpot_headroom):
            while self.pending and self.num_in_flight < self.day.max_in_flight:
                self.cluster.submit(self.pending.popleft(), events.now_s)
                self.num_in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.num_in_flight)
        if self.pending:
            events.after(self.day.tick_s, self.tick)

    def ended(self, now_s: float) -> None:
        self.num_in_flight -= 1
        self.num_ended += 1
        self.last_end_s = now_s


def batch_lines(day: BatchDay) -> list[BenchRequest]:
    return [
        BenchRequest(f"{BATCH_PREFIX}{i}", "batch", f"{BATCH_PREFIX}{i}",
                     (Segment("user", (TextBlock(f"batch-text-{i}", day.input_tokens),)),),
                     day.output_tokens)
        for i in range(day.num_lines)
    ]  # fmt: skip


def run_day(spec: ClusterSpec, day: BatchDay, *, with_batch: bool, seed: int = 0) -> DayResult:
    cluster = _BatchCluster(spec, seed)
    return _play(cluster, day, with_batch=with_batch, seed=seed)


@dataclass
class PlannedDay:
    day: DayResult
    replicas: list[ReplicaSample]  # every 5 s: desired, ready, holding a GPU
    decisions: list[DecisionLog]


def run_planned_day(
    spec: ClusterSpec,
    day: BatchDay,
    policy: Policy,
    *,
    startup_s: float,
    slo: Slo,
    with_batch: bool,
    seed: int = 0,
    counts_batch: bool = False,
) -> PlannedDay:
    """The day on colocated replicas the policy decides, starting at its initial count
    (`spec.num_workers` is ignored). `counts_batch`: the planner's metrics count the batch
    like online work (what it read before the metrics carried a class)."""
    elastic = ClusterSpec(spec.profile, num_workers=policy.initial_replicas())
    cluster = _ElasticBatchCluster(elastic, seed, startup_s)
    cluster.counts_batch = counts_batch
    replicas, decisions = drive(cluster, policy, slo, day.traffic.duration_s)
    result = _play(cluster, day, with_batch=with_batch, seed=seed)
    return PlannedDay(result, replicas, decisions)


def _play(
    cluster: _BatchCluster | _ElasticBatchCluster, day: BatchDay, *, with_batch: bool, seed: int
) -> DayResult:
    rng = random.Random(f"{seed}/batch-day")
    times = arrival_times_s(day.traffic, rng)
    for request, at_s in requests_for(times, day.traffic, rng, namespace=f"day-{seed}"):
        cluster.submit(request, at_s)
    runner = None
    if with_batch:
        runner = _Runner(cluster, day, collections.deque(batch_lines(day)))
        cluster.runner = runner
        cluster.events.at(day.submitted_at_s, runner.tick)
    records = cluster.run()
    online = [r for r in records if not r.request_id.startswith(BATCH_PREFIX)]
    batch = [r for r in records if r.request_id.startswith(BATCH_PREFIX)]
    is_done = runner is not None and runner.num_ended == day.num_lines
    return DayResult(
        online,
        batch,
        runner.last_end_s if runner is not None and is_done else None,
        runner.most_in_flight if runner is not None else 0,
    )
