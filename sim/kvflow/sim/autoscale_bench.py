"""The planner benchmark's grid: arms x traffic shapes x start-up delays, in virtual time.

Every cell runs the same requests (per shape and seed) on a fresh elastic cluster of the
same simulated workers. The static arms do not depend on the start-up delay (their pods
start once, before the traffic), so they run once per shape. Sizing:

- **planner** gets the capacity profile `capacity_from_timing` derives from the workers'
  step-time profile and the traffic's mean lengths (no measurement at all);
  **planner-measured** one measured here (`measured_capacity`: the rate one replica holds,
  as an operator measuring one worker would find it). Either is what a user would put in
  `autoscaling.replicaPromptTokensPerSecond` / `replicaDecodeTokensPerSecond`;
- **static-peak** is the fewest replicas that hold the peak rate for `probe_s` of steady
  Poisson traffic with at least 95 % attainment (measured here, the most favourable
  sizing a static pool can get), **static-mean** the same for the mean rate;
- **planner** and **reactive** start with the replicas the traffic at t = 0 needs (the
  static sizing of that rate): a pool sized for the traffic it had, not a cold start.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.operator.planner import CapacityProfile, Tuning, capacity_from_timing
from kvflow.router.serving.admission import AdmissionConfig
from kvflow.sim.autoscale import RunResult, Slo, run
from kvflow.sim.autoscale_metrics import Score, score
from kvflow.sim.autoscale_policies import Planner, Policy, Reactive, Static, planner_config
from kvflow.sim.autoscale_traffic import Traffic
from kvflow.sim.pool import process_pool

ARMS = ("planner", "planner-measured", "static-peak", "static-mean", "reactive")
STATIC_TARGET = 0.95


@dataclass(frozen=True)
class BenchConfig:
    profile: str = "h200x2-llama3-70b"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.06))
    input_tokens: tuple[int, int] = (128, 384)
    output_tokens: tuple[int, int] = (32, 96)
    peak_rate_per_s: float = 40.0
    durations_s: dict[str, float] = field(
        default_factory=lambda: {"diurnal": 2400.0, "step": 1800.0, "trace": 1200.0}
    )
    shapes: tuple[str, ...] = ("diurnal", "step", "trace")
    startups_s: tuple[float, ...] = (0.0, 30.0, 60.0, 120.0)
    arms: tuple[str, ...] = ARMS
    min_replicas: int = 1
    max_replicas: int = 16
    initial_replicas: int | None = None  # None: the static sizing of the rate at t = 0
    probe_s: float = 120.0
    seed: int = 0
    # The planner's Tuning.target_utilization / scale_down_utilization (None: its defaults).
    utilization: tuple[float, float] | None = None
    # The planner's Tuning.scale_down_latency_ratio: a scale-down needs latency under this
    # share of its target (None: its default, 0.6).
    calm_latency_ratio: float | None = None
    # The planner's Tuning.forecast_damping_s: how long a load slope is trusted (None: its
    # default, 60 s).
    forecast_damping_s: float | None = None
    # The planner's autoscaling.intervalSeconds (the CRD's default); the reactive arm syncs
    # every 15 s (HPA's default).
    planner_interval_s: float = 30.0
    # The planner's Tuning.pooled_from_shares: False sizes every pool in proportion to its
    # load (the rule before the pooled margin), for an A/B of the two.
    pooled_margin: bool = True
    # Both dynamic arms' scale-down stabilization window (HPA's and the CRD's default).
    stabilization_s: float = 300.0
    # The gateway's admission control for every arm, as its --admission-max-queue-time-s
    # (the shed bound set to the same: one tenant); None: off, every request queues.
    admission_max_queue_s: float | None = None

    def admission(self) -> AdmissionConfig | None:
        s = self.admission_max_queue_s
        return None if s is None else AdmissionConfig(shed_queue_time_s=s, max_queue_time_s=s)

    def sim_profile(self) -> SimProfile:
        return dataclasses.replace(
            resolve_profile(self.profile),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def traffic(self, shape: str) -> Traffic:
        return Traffic(
            shape,
            self.durations_s[shape],
            self.peak_rate_per_s,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
        )

    def capacity(self) -> CapacityProfile:
        p = self.sim_profile()
        return capacity_from_timing(
            p.timing,
            mean_input_tokens=sum(self.input_tokens) / 2,
            mean_output_tokens=sum(self.output_tokens) / 2,
            ttft_target_s=self.slo.ttft_s,
            tpot_target_s=self.slo.tpot_s,
            percentile=self.slo.percentile,
            max_num_batched_tokens=p.max_num_batched_tokens,
            max_num_seqs=p.max_num_seqs,
            kv_capacity_tokens=p.num_kv_blocks * p.block_size,
            source=f"{p.name} (derived)",
            colocated=True,  # the benchmark's one role is colocated
        )  # fmt: skip


@dataclass(frozen=True)
class Cell:
    arm: str
    shape: str
    startup_s: float
    static_replicas: int = 0  # static arms: the fixed count; others: where they start


def steady(config: BenchConfig, rate: float) -> Traffic:
    """Poisson at `rate` for `probe_s` (a diurnal day with no night)."""
    return Traffic(
        "diurnal",
        config.probe_s,
        rate,
        trough_fraction=1.0,
        input_tokens=config.input_tokens,
        output_tokens=config.output_tokens,
    )


def measured_capacity(config: BenchConfig) -> CapacityProfile:
    """The derived profile rescaled to what one replica measurably holds.

    The highest steady rate one replica serves at STATIC_TARGET attainment (bisection to
    0.5 req/s), then both capacities scaled by the derived profile's shares at that rate
    (prompt plus output tokens/s over their capacities), so that rate is exactly one
    replica's worth: what an operator measuring one worker would write into the pool.
    """
    derived = config.capacity()
    profile = config.sim_profile()
    lo, hi = 0.5, config.peak_rate_per_s
    held = None
    while hi - lo > 0.5:
        mid = (lo + hi) / 2
        result = run(profile, steady(config, mid), Static("probe", 1), startup_s=0,
                     slo=config.slo, admission=config.admission())  # fmt: skip
        if score(result, config.slo).attainment >= STATIC_TARGET:
            lo, held = mid, result
        else:
            hi = mid
    if held is None:
        raise ValueError(f"one replica holds no rate >= {lo} req/s within the SLO")
    held_shares = shares(config, lo)
    return CapacityProfile(
        max_prompt_tokens_per_s=derived.max_prompt_tokens_per_s * held_shares,
        max_decode_tokens_per_s=derived.max_decode_tokens_per_s * held_shares,
        source=f"measured: one replica holds {lo:.1f} req/s",
    )


def smallest_static(config: BenchConfig, rate: float) -> int:
    """Fewest replicas holding `rate` steady at STATIC_TARGET attainment (module docstring).

    The search starts at the replica shares the derived profile gives the rate, rounded up,
    and walks down while one fewer holds, or up until one holds: two probes where it is
    right, where counting from one replica simulated every undersized pool (18 probes of an
    overloaded pool at 200 requests/s, a minute each).
    """
    profile = config.sim_profile()

    def holds(n: int) -> bool:
        result = run(profile, steady(config, rate), Static("probe", n), startup_s=0,
                     slo=config.slo, admission=config.admission())  # fmt: skip
        return score(result, config.slo).attainment >= STATIC_TARGET

    lo, hi = config.min_replicas, config.max_replicas
    n = min(hi, max(lo, math.ceil(shares(config, rate) - 1e-9)))
    if holds(n):
        while n > lo and holds(n - 1):
            n -= 1
        return n
    while n < hi:
        n += 1
        if holds(n):
            return n
    return hi


def shares(config: BenchConfig, rate: float) -> float:
    """Replica shares of `rate` requests/s by the derived profile."""
    capacity = config.capacity()
    return rate * (
        sum(config.input_tokens) / 2 / capacity.max_prompt_tokens_per_s
        + sum(config.output_tokens) / 2 / capacity.max_decode_tokens_per_s
    )


def follower_replica_hours(config: BenchConfig, shape: str, startup_s: float = 0.0) -> float:
    """A bound for the planner: replica-hours of a pool that always has exactly the
    replicas its margin sizes the offered rate for (`Tuning.replicas_for` at the target
    utilisation, at least `min_replicas`), with no lag and no forecast error.

    With `startup_s` 0 the pods are instant: the *instant follower*. With a start-up, a
    replica ordered now serves `startup_s` later, so a pool that keeps its margin holds at
    each second what the most load of the next `startup_s` seconds needs (a clairvoyant
    scaler, shrinking the moment the load allows): what any scaler with that margin and
    that start-up pays at least. For the trace, whose `rate_at` is its mean, this is the
    flat mean's sizing.
    """
    t = tuning(config) or Tuning()
    traffic = config.traffic(shape)
    num = max(1, int(traffic.duration_s))
    dt_s = traffic.duration_s / num
    sized = [
        max(
            config.min_replicas,
            t.replicas_for(shares(config, traffic.rate_at((i + 0.5) * dt_s)), t.target_utilization),
        )
        for i in range(num)
    ]
    ahead = max(0, math.ceil(startup_s / dt_s - 1e-9))
    total_s = sum(max(sized[i : i + ahead + 1]) * dt_s for i in range(num))
    return total_s / 3600


def tuning(config: BenchConfig) -> Tuning | None:
    """The planner's Tuning for the config (None: its defaults)."""
    changes: dict[str, object] = {}
    if config.utilization is not None:
        changes["target_utilization"], changes["scale_down_utilization"] = config.utilization
    if config.calm_latency_ratio is not None:
        changes["scale_down_latency_ratio"] = config.calm_latency_ratio
    if config.forecast_damping_s is not None:
        changes["forecast_damping_s"] = config.forecast_damping_s
    if not config.pooled_margin:
        changes["pooled_from_shares"] = None
    return dataclasses.replace(Tuning(), **changes) if changes else None  # type: ignore[arg-type]


def policy_for(config: BenchConfig, cell: Cell, measured: CapacityProfile | None = None) -> Policy:
    if cell.static_replicas < 1:
        raise ValueError(f"{cell.arm}: needs at least one replica to start with")
    if cell.arm in ("static-peak", "static-mean"):
        return Static(cell.arm, cell.static_replicas)
    if cell.arm == "reactive":
        return Reactive(
            config.min_replicas,
            config.max_replicas,
            cell.static_replicas,
            stabilization_s=config.stabilization_s,
        )
    if cell.arm in ("planner", "planner-measured"):
        capacity = config.capacity()
        if cell.arm == "planner-measured":
            assert measured is not None, "planner-measured runs on the measured profile"
            capacity = measured
        return Planner(
            planner_config(
                capacity=capacity,
                min_replicas=config.min_replicas,
                max_replicas=config.max_replicas,
                initial=cell.static_replicas,
                ttft_target_s=config.slo.ttft_s,
                tpot_target_s=config.slo.tpot_s,
                percentile=config.slo.percentile,
                startup_s=cell.startup_s,
                interval_s=config.planner_interval_s,
                tuning=tuning(config),
                scale_down_stabilization_s=config.stabilization_s,
            ),
            name=cell.arm,
        )
    raise ValueError(f"unknown arm {cell.arm!r}: use one of {', '.join(ARMS)}")


def run_cell(
    config: BenchConfig, cell: Cell, measured: CapacityProfile | None = None
) -> tuple[Cell, Score, RunResult]:
    result = run(
        config.sim_profile(),
        config.traffic(cell.shape),
        policy_for(config, cell, measured),
        startup_s=cell.startup_s,
        slo=config.slo,
        seed=config.seed,
        admission=config.admission(),
    )
    return cell, score(result, config.slo), result


def cells(config: BenchConfig, static: dict[str, dict[str, int]]) -> list[Cell]:
    out = []
    for shape in config.shapes:
        for arm in config.arms:
            if arm.startswith("static"):
                out.append(Cell(arm, shape, 0.0, static[shape][arm]))
            else:
                out.extend(Cell(arm, shape, s, static[shape]["initial"]) for s in config.startups_s)
    return out


def run_grid(
    config: BenchConfig, *, jobs: int = 1, done: Callable[[Cell, Score], None] | None = None
) -> list[tuple[Cell, Score, RunResult]]:
    by_rate: dict[float, int] = {}
    static: dict[str, dict[str, int]] = {}
    for shape in config.shapes:
        traffic = config.traffic(shape)
        rates = {"static-peak": config.peak_rate_per_s,
                 "static-mean": traffic.mean_rate_per_s,
                 "initial": traffic.rate_at(0.0)}  # fmt: skip
        for arm, rate in rates.items():
            if (arm in config.arms or arm == "initial") and rate not in by_rate:
                by_rate[rate] = smallest_static(config, rate)
        static[shape] = {arm: by_rate.get(rate, 0) for arm, rate in rates.items()}
        if config.initial_replicas is not None:
            static[shape]["initial"] = config.initial_replicas
    measured = measured_capacity(config) if "planner-measured" in config.arms else None
    todo = cells(config, static)
    if jobs <= 1:  # in this process
        return _collected((run_cell(config, cell, measured) for cell in todo), done)
    with process_pool(jobs) as pool:
        futures = [pool.submit(run_cell, config, cell, measured) for cell in todo]
        return _collected((future.result() for future in futures), done)


def _collected(
    items: Iterable[tuple[Cell, Score, RunResult]], done: Callable[[Cell, Score], None] | None
) -> list[tuple[Cell, Score, RunResult]]:
    results = []
    for item in items:
        results.append(item)
        if done is not None:
            done(item[0], item[1])
    return results
