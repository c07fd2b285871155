"""The calibration check: does a fitted profile predict the real engine's latencies?

The same open-loop traffic (a bench workload, Poisson arrivals, seeded) runs twice: on the
real engine in this process in wall time, and on one simulated worker with the profile in
virtual time. Both sides build the same engine configuration (block size, step budget,
sequences, KV blocks, context), so they schedule alike; the P50s of TTFT and TPOT are
compared. The real side's steps are also set against the profile's step model: their
median ratio, the *step drift*, says how far the machine moved between the fit and the
check (another job's caches, a throttled or shared core), apart from what the simulator
gets wrong about queueing and scheduling.

The real side keeps time one of two ways. ``wall``: the wall clock, as a worker lives it;
on a machine other jobs share, their load inflates every step. ``cpu`` (the default): the
engine's own clock advances by the CPU time each step took on this thread (torch on one
thread does all its work there) and jumps over idle time to the next arrival: what the
steps cost on a core of their own, whatever else runs. Use the clock the profile was
fitted with.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sim.fit import StepSample
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.engine_worker.sim.sweep import ShapeRecorder
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.ladder import LadderPlan, open_loop_schedule
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits, summarize
from kvflow.loadgen.workload import BenchRequest, Workload
from kvflow.proto.step_model import StepTiming
from kvflow.sim.arms import ARMS
from kvflow.sim.cluster import ClusterSpec, VirtualCluster
from kvflow.sim.prompts import PromptBuilder


@dataclass(frozen=True)
class RealRun:
    records: list[RequestRecord]
    steps: list[StepSample]  # each step's shape and the seconds it took on the run's clock


@dataclass(frozen=True)
class Calibration:
    real: LoadPointSummary
    simulated: LoadPointSummary
    real_steps: tuple[StepSample, ...]
    timing: StepTiming  # the profile's step model

    @property
    def step_drift(self) -> float | None:
        """Median of measured / modelled seconds over the real run's steps, minus one:
        +0.2 means the engine's steps ran 20 % slower than the profile says."""
        ratios = [
            step.seconds / modelled
            for step in self.real_steps
            if (modelled := self.timing.shape_s(step.shape)) > 0
        ]
        return statistics.median(ratios) - 1 if ratios else None

    @staticmethod
    def _error(real: float | None, simulated: float | None) -> float | None:
        if real is None or simulated is None or real == 0:
            return None
        return (simulated - real) / real

    @property
    def ttft_p50_error(self) -> float | None:
        return self._error(self.real.latency.ttft_s.p50, self.simulated.latency.ttft_s.p50)

    @property
    def tpot_p50_error(self) -> float | None:
        return self._error(self.real.latency.tpot_s.p50, self.simulated.latency.tpot_s.p50)

    @property
    def ttft_mean_error(self) -> float | None:
        return self._error(self.real.latency.ttft_s.mean, self.simulated.latency.ttft_s.mean)

    @property
    def tpot_mean_error(self) -> float | None:
        return self._error(self.real.latency.tpot_s.mean, self.simulated.latency.tpot_s.mean)


def run_real(
    engine: Engine,
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    *,
    clock: str = "cpu",
) -> RealRun:
    """Open loop on the real engine: each request is added at the first step boundary
    after its time (as the worker's engine loop does), its tokens stamped when the step
    that made them ends. ``clock``: ``cpu`` or ``wall`` (module docstring)."""
    prompts = PromptBuilder()
    pending = sorted(zip(offsets_s, range(len(requests)), strict=True))
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    records: list[RequestRecord] = []
    steps: list[StepSample] = []
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    wall_start_s = time.perf_counter()
    now_s = 0.0  # the cpu clock
    next_arrival = 0

    def elapsed() -> float:
        return time.perf_counter() - wall_start_s if clock == "wall" else now_s

    try:
        while next_arrival < len(pending) or engine.has_unfinished_requests:
            while next_arrival < len(pending) and pending[next_arrival][0] <= elapsed():
                offset_s, i = pending[next_arrival]
                request = requests[i]
                params = SamplingParams(max_tokens=request.num_output_tokens, ignore_eos=True)
                engine.add_request(request.request_id, prompts.token_ids(request), params)
                arrivals[request.request_id] = offset_s
                token_times[request.request_id] = []
                next_arrival += 1
            if not engine.has_schedulable_work:
                idle_s = pending[next_arrival][0] - elapsed()
                if clock == "wall":
                    time.sleep(max(0.0, idle_s))
                else:
                    now_s += max(0.0, idle_s)
                continue
            recorder.last = None
            cpu_start_s, wall_step_start_s = time.thread_time(), time.perf_counter()
            outputs = engine.step()
            step_s = (time.thread_time() - cpu_start_s if clock == "cpu"
                      else time.perf_counter() - wall_step_start_s)  # fmt: skip
            now_s += step_s
            if recorder.last is not None:
                steps.append(StepSample(recorder.last, step_s))
            done_s = elapsed()
            for out in outputs:
                token_times[out.request_id].extend([done_s] * len(out.new_tokens))
                if out.finish_reason is None:
                    continue
                arrival_s = arrivals.pop(out.request_id)
                records.append(
                    RequestRecord(
                        request_id=out.request_id,
                        scheduled_s=arrival_s,
                        sent_s=arrival_s,
                        end_s=done_s,
                        token_times_s=tuple(token_times.pop(out.request_id)),
                        num_output_tokens=out.num_output_tokens,
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                    )
                )
    finally:
        engine.runner = recorder.inner
    records.sort(key=lambda r: (r.sent_s, r.request_id))
    return RealRun(records, steps)


def calibrate(
    engine: Engine,
    profile: SimProfile,
    workload: Workload,
    *,
    rate_per_s: float,
    duration_s: float,
    warmup_s: float,
    seed: int = 0,
    clock: str = "cpu",
) -> Calibration:
    """Run the traffic on ``engine`` (wall time), then on the profile (virtual time)."""
    point = LoadPoint(ArrivalKind.POISSON, rate_per_s)
    # Schedule limits do not apply to the simulated side; the real side's Python loop adds
    # a request only between steps, which the simulated worker does too.
    plan = LadderPlan(workload, [point], seed, warmup_s, duration_s, None, Slo(10.0, 1.0),
                      ScheduleLimits(max_lag_s=1e9, min_rate_fraction=0.0),
                      engine.config.scheduler.block_size)  # fmt: skip
    schedule = open_loop_schedule(plan, point, 0)
    real = run_real(engine, schedule.requests, schedule.offsets_s, clock=clock)
    scheduler = engine.config.scheduler
    spec = ClusterSpec(
        profile,
        num_workers=1,
        num_kv_blocks=engine.config.num_kv_blocks,
        max_model_len=engine.max_len,
    )
    cluster = VirtualCluster(spec, ARMS["round-robin"], seed=seed)
    if spec.engine_config().scheduler != scheduler:
        raise ValueError(
            f"the profile's limits ({spec.engine_config().scheduler}) differ from the "
            f"engine's ({scheduler}): fit the profile with the same settings"
        )
    for request, offset_s in zip(schedule.requests, schedule.offsets_s, strict=True):
        cluster.submit(request, offset_s)
    sim_records = cluster.run()

    def summary(records: list[RequestRecord]) -> LoadPointSummary:
        return summarize(point, records, warmup_s=warmup_s,
                         offered_rate_per_s=schedule.offered_rate_per_s, slo=plan.slo,
                         limits=plan.limits, block_size=scheduler.block_size)  # fmt: skip

    return Calibration(summary(real.records), summary(sim_records), tuple(real.steps),
                       profile.timing)  # fmt: skip
