"""The planner benchmark's traffic, arms, scores, and a short run of the planner."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvflow.loadgen.records import RequestRecord
from kvflow.operator.planner import Observation
from kvflow.sim.autoscale import ReplicaSample, Slo, run
from kvflow.sim.autoscale_bench import (
    BenchConfig,
    Cell,
    follower_replica_hours,
    measured_capacity,
    policy_for,
    run_cell,
    shares,
    smallest_static,
    steady,
)
from kvflow.sim.autoscale_cli import config_from, main, parser
from kvflow.sim.autoscale_metrics import Bucket, Score, recovery_s, replica_hours, score
from kvflow.sim.autoscale_policies import Planner, PoolSample, Reactive, Static
from kvflow.sim.autoscale_report import report_dict, table
from kvflow.sim.autoscale_traffic import Traffic, arrival_times_s, trace_times_s

TRACES = Path(__file__).parents[2] / "traces" / "mooncake-fast25"


def test_diurnal_and_step_rates() -> None:
    day = Traffic("diurnal", 1000, 50.0, trough_fraction=0.2)
    assert day.rate_at(0) == pytest.approx(10.0)
    assert day.rate_at(500) == pytest.approx(50.0)
    assert day.mean_rate_per_s == pytest.approx(30.0, rel=1e-3)
    times = arrival_times_s(day, random.Random(1))
    assert len(times) / 1000 == pytest.approx(30.0, rel=0.05)  # thinning keeps the mean
    step = Traffic("step", 1000, 50.0)
    assert [step.rate_at(t) for t in (100, 250, 500, 700)] == [10.0, 50.0, 50.0, 10.0]
    assert step.step_times_s == (200.0, 600.0)


def test_trace_timestamps_are_sped_up_to_the_rate() -> None:
    traffic = Traffic("trace", 600, 20.0, trace_path=TRACES / "synthetic_trace.jsonl")
    times = trace_times_s(traffic)
    # 3,993 requests over 1,022 s (3.9/s) played at 20/s: 600 s hold about 12,000.
    assert len(times) / 600 == pytest.approx(20.0, rel=0.02)
    assert times == sorted(times) and times[-1] < 600


def _sample(now: float, replicas: int, waiting: float, kv: float) -> PoolSample:
    obs = Observation(time_s=now, desired_replicas=replicas, ready_replicas=replicas)
    return PoolSample(obs, num_waiting_per_replica=waiting, kv_usage=kv)


def test_reactive_is_hpa_like() -> None:
    hpa = Reactive(min_replicas=1, max_replicas=20, initial=2)
    assert hpa.decide(_sample(0, 2, waiting=6.0, kv=0.3)) == (6, "QueueLength")  # 2 x 6/2
    assert hpa.decide(_sample(15, 6, waiting=0.0, kv=0.75))[0] == 6  # within 10 % of target
    # Scale-up at most doubles (or +4): 6 -> 12, not 6 x 5.
    assert hpa.decide(_sample(30, 6, waiting=10.0, kv=0.3)) == (12, "QueueLength")
    # Down only to the most recommended over 300 s.
    assert hpa.decide(_sample(60, 12, waiting=0.0, kv=0.35))[0] == 12
    assert hpa.decide(_sample(400, 12, waiting=0.0, kv=0.35)) == (6, "Underloaded")


def test_scores() -> None:
    samples = [ReplicaSample(5.0 * i, 2, 2, 2 if i < 360 else 4) for i in range(720)]
    assert replica_hours(samples) == pytest.approx(3.0)  # 0.5 h x 2 + 0.5 h x 4
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert slo.is_met(
        RequestRecord("a", 0, 0, 1, token_times_s=(0.5, 0.6, 0.7), num_output_tokens=3)
    )
    assert not slo.is_met(
        RequestRecord("b", 0, 0, 2, token_times_s=(0.5, 1.0, 1.5), num_output_tokens=3)
    )
    assert not slo.is_met(RequestRecord("c", 0, 0, 0, error="no_worker"))
    series = [Bucket(30.0 * i, 10, a, None, None) for i, a in enumerate([1, 1, 0.5, 0.8, 1, 1])]
    assert recovery_s(series, slo, step_up_s=60.0, step_down_s=180.0) == 60.0
    assert recovery_s(series, slo, step_up_s=120.0, step_down_s=180.0) == 0.0


# A 70B on two H200s (22 ms steps: few steps per virtual second, a cheap test) serving at
# most 4 sequences: one replica holds about 6 requests/s of these; the step asks for 20.
SMALL = BenchConfig(
    profile="h200x2-llama3-70b",
    max_num_seqs=4,
    max_num_batched_tokens=512,
    slo=Slo(ttft_s=0.5, tpot_s=0.04),
    input_tokens=(64, 192),
    output_tokens=(16, 32),
    peak_rate_per_s=20.0,
    durations_s={"step": 300.0},
    shapes=("step",),
    max_replicas=8,
    initial_replicas=1,
)


def test_the_planner_follows_a_step() -> None:
    _, planner, result = run_cell(SMALL, Cell("planner", "step", 0.0, static_replicas=1))
    # The step (4 -> 20 requests/s) comes at 60 s; the first scrape after it sizes the
    # pool from the arrivals (5 replicas of 4 sequences for the load), not one replica at
    # a time, plus one to drain what queued on the single replica in the 30 s before
    # (Backlog; sized for the load alone it was 5, ForecastLoad), and the SLO is back
    # within one bucket.
    ups = [(d.time_s, d.replicas, d.reason) for d in result.decisions if d.replicas > 1]
    assert ups[0] == (90.0, 6, "Backlog")
    assert planner.recovery_s is not None and planner.recovery_s <= 60.0
    assert planner.max_replicas <= 6


def test_measured_capacity_makes_one_replica_of_what_one_replica_holds() -> None:
    config = dataclasses.replace(SMALL, probe_s=30.0)
    cap = measured_capacity(config)
    assert cap.source.startswith("measured: one replica holds ")
    held = float(cap.source.split()[-2])
    assert 2.0 <= held <= 10.0  # 4 sequences of ~24 tokens at ~25 ms: about 6/s
    derived = config.capacity()
    ratio = cap.max_decode_tokens_per_s / derived.max_decode_tokens_per_s
    assert cap.max_prompt_tokens_per_s / derived.max_prompt_tokens_per_s == pytest.approx(ratio)


def test_static_sizing_starts_at_the_profile_and_finds_the_fewest_that_hold() -> None:
    config = dataclasses.replace(SMALL, probe_s=30.0)
    profile = config.sim_profile()

    def holds(n: int, rate: float) -> bool:
        result = run(profile, steady(config, rate), Static("probe", n), startup_s=0,
                     slo=config.slo)  # fmt: skip
        return score(result, config.slo).attainment >= 0.95

    for rate in (3.0, 20.0):
        n = smallest_static(config, rate)
        assert holds(n, rate), (rate, n)
        assert n == config.min_replicas or not holds(n - 1, rate), (rate, n)
    # The guess is the derived profile's shares rounded up: 20 requests/s are several.
    assert 2 < shares(config, 20.0) < config.max_replicas


def test_the_instant_follower_bound() -> None:
    # The step at 20 requests/s peak (4 in the low phase) on SMALL: the follower holds the
    # margin's sizing of each phase, high from 1/5 to 3/5 of 300 s (120 s), low 180 s.
    config = SMALL
    tune = policy_for(config, Cell("planner", "step", 0.0, static_replicas=1)).config.tuning
    high = tune.replicas_for(shares(config, 20.0), 0.8)
    low = max(1, tune.replicas_for(shares(config, 4.0), 0.8))
    assert high > low
    hours = follower_replica_hours(config, "step")
    assert hours == pytest.approx((high * 120 + low * 180) / 3600)
    # With a 45 s start-up a replica must be ordered 45 s before the load it serves: the
    # high phase's replicas are held from 45 s before it, and go the moment it ends.
    ahead = follower_replica_hours(config, "step", startup_s=45.0)
    assert ahead == pytest.approx((high * 165 + low * 135) / 3600)
    assert follower_replica_hours(config, "step", startup_s=0.0) == hours
    # The proportional margin never sizes a pool smaller.
    flat = dataclasses.replace(config, pooled_margin=False, peak_rate_per_s=200.0)
    pooled = dataclasses.replace(config, peak_rate_per_s=200.0)
    assert follower_replica_hours(pooled, "step") < follower_replica_hours(flat, "step")


def test_the_planner_margin_is_pooled_unless_asked_otherwise() -> None:
    cell = Cell("planner", "step", 0.0, static_replicas=1)
    planner = policy_for(SMALL, cell)
    assert isinstance(planner, Planner) and planner.config.tuning.pooled_from_shares == 4.0
    flat = policy_for(dataclasses.replace(SMALL, pooled_margin=False, utilization=(0.9, 0.7)), cell)
    assert isinstance(flat, Planner) and flat.config.tuning.pooled_from_shares is None
    assert flat.config.tuning.target_utilization == 0.9
    assert flat.config.tuning.scale_down_latency_ratio == 0.6  # the default
    relaxed = config_from(parser().parse_args(["--calm-latency-ratio", "0.8"]))
    assert relaxed.calm_latency_ratio == 0.8
    planner = policy_for(dataclasses.replace(SMALL, calm_latency_ratio=0.8), cell)
    assert isinstance(planner, Planner) and planner.config.tuning.scale_down_latency_ratio == 0.8
    assert planner.config.tuning.forecast_damping_s == 60.0  # the default
    damped = config_from(parser().parse_args(["--forecast-damping-s", "90"]))
    assert policy_for(damped, cell).config.tuning.forecast_damping_s == 90.0
    short = dataclasses.replace(SMALL, stabilization_s=60.0)
    assert policy_for(short, cell).config.scale_down_stabilization_s == 60.0
    reactive = policy_for(short, Cell("reactive", "step", 0.0, static_replicas=1))
    assert isinstance(reactive, Reactive) and reactive.stabilization_s == 60.0


def test_the_report_carries_both_bounds() -> None:
    rows = [(Cell("planner", "step", 60.0, static_replicas=1), _score(2.0), None)]
    text = table(rows, {"step": 1.0}, {"step": {60.0: 1.25}})  # type: ignore[list-item]
    assert "| step | instant follower (bound) | 0 s | - | 1.00 |" in text
    assert "| step | follower, start-up ahead (bound) | 60 s | - | 1.25 |" in text
    report = report_dict(SMALL, [], {"step": 1.0}, {"step": {60.0: 1.25}})
    assert report["follower_ahead_replica_hours"] == {"step": {"60": 1.25}}


def _score(replica_hours: float) -> Score:
    return Score(
        arm="planner",
        shape="step",
        startup_s=60.0,
        attainment=1.0,
        replica_hours=replica_hours,
        scale_events_per_hour=0.0,
        recovery_s=None,
        max_replicas=1,
        num_requests=1,
        num_refused=0,
    )


def test_runs_are_deterministic() -> None:
    profile = SMALL.sim_profile()
    traffic = dataclasses.replace(SMALL.traffic("step"), duration_s=60.0, peak_rate_per_s=5.0)
    a = run(profile, traffic, Static("s", 2), startup_s=0, slo=SMALL.slo)
    b = run(profile, traffic, Static("s", 2), startup_s=0, slo=SMALL.slo)
    assert a.records == b.records and a.replicas == b.replicas


def test_the_planner_runs_at_the_interval_given() -> None:
    cell = Cell("planner", "step", 60.0, static_replicas=1)
    assert policy_for(SMALL, cell).interval_s == 30.0  # the CRD's intervalSeconds
    fast = dataclasses.replace(SMALL, planner_interval_s=15.0)
    planner = policy_for(fast, cell)
    assert planner.interval_s == 15.0
    assert isinstance(planner, Planner) and planner.config.replica_startup_s == 60.0


def test_unknown_arm_and_bad_profile() -> None:
    with pytest.raises(ValueError, match="unknown arm 'hpa'"):
        policy_for(SMALL, Cell("hpa", "step", 0.0, static_replicas=1))
    err = _Capture()
    assert main(["--profile", "tpu-llama3-8b"], _Capture(), err) == 2
    assert "autoscale:" in err.text


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass
