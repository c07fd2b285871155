"""The routing comparison's targets, judged from hand-made ladders."""

from __future__ import annotations

import math

import pytest

from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import LoadPointSummary, summarize
from kvflow.proto.step_model import StepTiming
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import ArmLadder, ComparisonConfig, ComparisonResult, verdicts
from kvflow.sim.report import render
from kvflow.sim.targets import (
    balance_target,
    family_targets,
    hit_rate_target,
    knee_target,
    parity_target,
    saturation_index,
    ttft_targets,
)

SLO = Slo(ttft_s=1.0, tpot_s=0.1)


def point(rate: float, ttft_s: float, hit: float = 0.0, workers: tuple[int, ...] = (5, 5)
          ) -> LoadPointSummary:  # fmt: skip
    """``sum(workers)`` requests at ``rate``, each with this TTFT and hit rate, spread over
    workers as given."""
    records = []
    names = [f"w{i}" for i, n in enumerate(workers) for _ in range(n)]
    for i, worker in enumerate(names):
        sent = i / rate
        records.append(RequestRecord(f"r{i}", sent, sent, sent + ttft_s + 0.1,
                                     (sent + ttft_s, sent + ttft_s + 0.1), 2, 100,
                                     round(100 * hit), worker=worker))  # fmt: skip
    return summarize(LoadPoint(ArrivalKind.POISSON, rate), records, warmup_s=0.0,
                     offered_rate_per_s=rate, slo=SLO)  # fmt: skip


def ladder(ttfts: list[float], **kw: object) -> list[LoadPointSummary]:
    return [point(10.0 * (i + 1), t, **kw) for i, t in enumerate(ttfts)]  # type: ignore[arg-type]


def test_knee_ratio_against_the_worse_of_two_baselines() -> None:
    ladders = {
        "kvflow": ladder([0.1, 0.1, 0.2, 0.5, 3.0]),  # knee 40
        "round-robin": ladder([0.2, 0.9, 5.0, 9.0, 9.0]),  # knee 20
        "least-loaded": ladder([0.2, 1.5, 5.0, 9.0, 9.0]),  # knee 10
    }
    verdict = knee_target(ladders, ["round-robin", "least-loaded"])
    assert verdict.is_met and verdict.value == pytest.approx(2.0)
    ladders["kvflow"] = ladder([0.1, 0.1, 0.2, 1.5, 3.0])  # knee 30: 1.5x round-robin's
    assert not knee_target(ladders, ["round-robin", "least-loaded"]).is_met


def test_ttft_at_and_before_the_baselines_saturation() -> None:
    ours = ladder([0.05, 0.06, 0.2])
    theirs = ladder([0.1, 0.08, 2.5])
    assert saturation_index(theirs, SLO) == 2
    at, before = ttft_targets({"kvflow": ours, "round-robin": theirs}, "round-robin", SLO)
    assert at.value == pytest.approx(12.5) and at.is_met
    assert before.value == pytest.approx(0.08 / 0.06) and not before.is_met  # 1.33x < 1.5x
    [never] = ttft_targets({"kvflow": ours, "round-robin": ours}, "round-robin", SLO)
    assert not never.is_met and math.isnan(never.value)


def test_hit_rate_balance_and_parity() -> None:
    ours = ladder([0.1, 0.1], hit=0.73, workers=(6, 4))
    ideal = ladder([0.1, 0.1], hit=0.8)
    hits = hit_rate_target("w", {"kvflow": ours, "ideal": ideal}, SLO)
    assert hits.value == pytest.approx(0.9125) and hits.is_met
    # Past its own saturation the default's rungs are listed, not judged: there requests
    # queue without bound and evict each other's prefixes, while the ideal's oracle cannot.
    ours_past = [*ours, point(30.0, 2.0, hit=0.73), point(40.0, 3.0, hit=0.4)]
    ideal_past = [*ideal, point(30.0, 0.1, hit=0.8), point(40.0, 0.1, hit=0.8)]
    judged = hit_rate_target("w", {"kvflow": ours_past, "ideal": ideal_past}, SLO)
    assert judged.is_met and "judged up to 30 req/s" in judged.detail
    ours_past[2] = point(30.0, 2.0, hit=0.4)  # the first rung past the knee is judged
    assert not hit_rate_target("w", {"kvflow": ours_past, "ideal": ideal_past}, SLO).is_met
    # No rung meets the SLO (a trace whose longest prompts alone take longer): all judged.
    slow = [point(10.0, 1.5, hit=0.73), point(20.0, 1.6, hit=0.6)]
    slow_ideal = [point(10.0, 1.4, hit=0.8), point(20.0, 1.4, hit=0.8)]
    all_judged = hit_rate_target("w", {"kvflow": slow, "ideal": slow_ideal}, SLO)
    assert not all_judged.is_met and all_judged.value == pytest.approx(0.75)
    balance = balance_target("w", {"kvflow": ours})
    assert balance.value == pytest.approx(1.2) and balance.is_met  # 6 of a mean 5
    assert not balance_target("w", {"kvflow": ladder([0.1], workers=(7, 3))}).is_met
    ll = ladder([0.10, 0.20, 3.0])
    assert parity_target({"kvflow": ladder([0.104, 0.2, 3.0]), "least-loaded": ll}, SLO).is_met
    assert not parity_target({"kvflow": ladder([0.11, 0.2, 3.0]), "least-loaded": ll}, SLO).is_met


def test_numbers_without_a_target_are_reported_as_info_never_met() -> None:
    # The Mooncake TTFT ratios have no target of the issue's: a worse P90 is not "met".
    config = ComparisonConfig(trace_path="", arms=["kvflow", "round-robin"], slo=SLO)
    spec = ClusterSpec(SimProfile("p", StepTiming(0.01), 16, 1024, 64, 256, 8, 1e9, "test"))
    result = ComparisonResult(config, spec)
    for arm, ttft_s in (("kvflow", 0.5), ("round-robin", 0.4)):
        result.ladders.append(ArmLadder("mooncake", arm, ladder([ttft_s]), [[]], 0.0))
    [info] = [v for v in verdicts(result) if v.name.startswith("mooncake 10 req/s")]
    assert not info.is_target and info.value == pytest.approx(0.8)
    assert f"info {info.name}" in render(result) and "met  mooncake 10" not in render(result)


def test_family_targets_judge_up_to_least_loadeds_knee_and_round_robin_past_it() -> None:
    from kvflow.sim.targets import family_targets

    ladders = {
        "kvflow": ladder([0.20, 0.30, 2.0]),
        "least-loaded": ladder([0.25, 0.30, 5.0]),  # knee: the first two rungs
        "ideal": ladder([0.19, 0.28, 1.5]),
        "round-robin": ladder([0.25, 0.35, 6.0]),
    }
    p90_ll, p90_ideal, p50, past = family_targets("conv", ladders, SLO)
    assert p90_ll.is_met and p90_ll.value == pytest.approx(1.0)
    assert p90_ideal.is_met and p90_ideal.value == pytest.approx(0.30 / 0.28)
    assert p50.is_met
    assert past.is_met and past.value == pytest.approx(2.0 / 6.0)
    ladders["kvflow"] = ladder([0.20, 0.32, 4.0])
    p90_ll, p90_ideal, _, past = family_targets("conv", ladders, SLO)
    assert not p90_ll.is_met and not p90_ideal.is_met and not past.is_met


def test_a_report_whose_target_has_no_rung_to_judge_is_valid_json() -> None:
    """A family that no rung takes past least-loaded's knee has no past-the-knee ratio
    (NaN): the JSON report writes it as null instead of failing on NaN."""
    import json

    from kvflow.sim.report import report_dict

    config = ComparisonConfig(trace_path="", arms=["kvflow", "least-loaded", "round-robin"],
                              slo=SLO)  # fmt: skip
    spec = ClusterSpec(SimProfile("p", StepTiming(0.01), 16, 1024, 64, 256, 8, 1e9, "test"))
    result = ComparisonResult(config, spec)
    for arm in config.arms:
        result.ladders.append(ArmLadder("agent", arm, ladder([0.2]), [[]], 0.0))
    report = json.loads(json.dumps(report_dict(result), allow_nan=False))
    [past] = [t for t in report["targets"] if "past the knee" in t["name"]]
    assert past["value"] is None and not past["is_target"]


def test_past_the_knee_round_robins_p90_counts_above_the_ttft_floor() -> None:
    """The Mooncake trace's shape at 1x: every arm over the 1 s SLO, most of it the longest
    prompts' own prefill (the floor, kvflow.sim.floor)."""
    ladders = {"kvflow": ladder([0.906]), "least-loaded": ladder([1.031]),
               "round-robin": ladder([0.998])}  # fmt: skip

    def past_knee(floors: list[float | None]) -> float:
        (verdict,) = [v for v in family_targets("mooncake", ladders, SLO, floors)
                      if "past the knee" in v.name]  # fmt: skip
        return verdict.value

    assert past_knee([]) == pytest.approx(0.906 / 0.998)  # no floor known: the plain ratio
    assert past_knee([None]) == pytest.approx(0.906 / 0.998)
    assert past_knee([0.88]) == pytest.approx(0.026 / 0.118)  # 0.22: met
    # Round-robin at the floor: nothing left to halve; no worse than it meets it.
    at_floor = ladders["round-robin"][0].latency.ttft_p90_with_failures_s
    assert past_knee([at_floor]) == 0.0
    ladders["kvflow"] = ladder([1.2])
    assert math.isinf(past_knee([at_floor]))


def test_a_workload_with_no_rung_up_to_the_knee_lists_those_targets_unjudged() -> None:
    """Least-loaded over the SLO at every rung: the up-to-the-knee targets are info, not
    misses (the report said MISS with no value); the past-the-knee one is judged."""
    ladders = {"kvflow": ladder([1.1, 1.2]), "least-loaded": ladder([1.5, 2.0]),
               "round-robin": ladder([3.0, 4.0]), "ideal": ladder([1.0, 1.1])}  # fmt: skip
    verdicts_ = family_targets("mooncake", ladders, SLO)
    unjudged = [v for v in verdicts_ if "past the knee" not in v.name]
    assert len(unjudged) == 3
    assert all(not v.is_target and math.isnan(v.value) for v in unjudged), unjudged
    (past,) = [v for v in verdicts_ if "past the knee" in v.name]
    assert past.is_target and past.is_met and past.value == pytest.approx(1.1 / 3.0)
