"""The routing comparison end to end, scaled down for CI (docs/benchmarks.md has the full
run): real engines, the real routing pipeline, the comparison's own targets code.

4 workers of the shipped H100 x Llama-3-8B timing, each with 512 KV blocks (8,192 tokens);
24 groups share 1,024-token prefixes (24,576 tokens: 3x one worker's KV), so round-robin
and least-loaded routing make every worker cycle through every prefix and miss, while a
prefix-aware router keeps about 6 prefixes on each. Asserted: the behaviour the issue's
targets describe (the default's knee and TTFT beat the load-only baselines, its hit rate
tracks the ideal, its load stays balanced, it is at parity on the no-reuse control), with
margins wide enough for a small run, not the full run's numbers.
"""

from __future__ import annotations

import pytest

from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.no_reuse import NoReuseWorkload
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.loadgen.summary import knee
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import ArmLadder, ComparisonConfig, ComparisonResult, verdicts
from kvflow.sim.ladders import SimLadder, run_ladder

# A 1,152-token prompt prefills in 38 ms, its 128-token question alone in 10 ms: 200 ms
# is about five full prefills of queueing.
SLO = Slo(ttft_s=0.2, tpot_s=0.1)
ARMS = ("kvflow", "round-robin", "least-loaded", "ideal")


def _points(rates: tuple[float, ...]) -> list[LoadPoint]:
    return [LoadPoint(ArrivalKind.POISSON, r) for r in rates]


@pytest.fixture(scope="module")
def result() -> ComparisonResult:
    profile = named_profile("h100-llama3-8b")
    assert profile is not None
    spec = ClusterSpec(profile, num_workers=4, num_kv_blocks=512)
    shared = SimLadder("shared-prefix", SharedPrefixWorkload(24, 4, (1024,), 128, 16),
                       _points((40, 80, 120, 160)), SLO, seed=0, warmup_requests=200,
                       measured_requests=200)  # fmt: skip
    no_reuse = SimLadder("no-reuse", NoReuseWorkload(1152, 16), _points((20, 60)), SLO,
                         seed=0, warmup_requests=20, measured_requests=200)  # fmt: skip
    config = ComparisonConfig(trace_path="", num_workers=4, num_kv_blocks=512, arms=ARMS, slo=SLO)
    out = ComparisonResult(config, spec)
    for ladder, arms in ((shared, ARMS), (no_reuse, ("kvflow", "least-loaded"))):
        for arm in arms:
            runs = run_ladder(spec, resolve_arm(arm), ladder)
            out.ladders.append(ArmLadder(ladder.name, arm, [r.summary for r in runs],
                                         [r.workers for r in runs], 0.0))  # fmt: skip
    return out


def _p90(point: object) -> float:
    return point.latency.ttft_p90_with_failures_s or 0.0  # type: ignore[attr-defined]


def test_the_default_saturates_later_and_waits_less(result: ComparisonResult) -> None:
    sp = result.by_workload("shared-prefix")
    knees = {arm: (k.qps if (k := knee(points)) is not None else 0.0) for arm, points in sp.items()}
    assert knees["kvflow"] >= 1.5 * max(knees["round-robin"], knees["least-loaded"]), knees
    for ours, rr, ll in zip(sp["kvflow"], sp["round-robin"], sp["least-loaded"], strict=True):
        assert _p90(ours) < min(_p90(rr), _p90(ll)), ours.label


def test_the_default_hits_nearly_what_the_ideal_does_and_stays_balanced(
    result: ComparisonResult,
) -> None:
    sp = result.by_workload("shared-prefix")
    for ours, ideal, rr in zip(sp["kvflow"], sp["ideal"], sp["round-robin"], strict=True):
        assert (ours.cache.hit_rate or 0) >= 0.9 * (ideal.cache.hit_rate or 1), ours.label
        assert (ours.cache.hit_rate or 0) > 2 * (rr.cache.hit_rate or 0), ours.label
        # 200 requests over 4 workers: 50 each, give or take sampling noise.
        assert (ours.cache.load_imbalance or 9.0) <= 1.35, ours.label


def test_the_default_is_at_parity_with_least_loaded_without_reuse(
    result: ComparisonResult,
) -> None:
    nr = result.by_workload("no-reuse")
    for ours, theirs in zip(nr["kvflow"], nr["least-loaded"], strict=True):
        assert ours.cache.hit_rate == 0.0
        assert _p90(ours) <= 1.15 * _p90(theirs), ours.label


def test_every_target_is_judged(result: ComparisonResult) -> None:
    names = [v.name for v in verdicts(result)]
    assert names[:3] == [
        "knee QPS vs round-robin and least-loaded",
        "TTFT P90 at round-robin's saturation (120 req/s)",
        "TTFT P90 before round-robin's saturation",
    ]
    assert "shared-prefix: hit rate vs ideal" in names
    assert "no-reuse: TTFT P90 and knee vs least-loaded" in names
    assert {"shared-prefix: max/mean load", "no-reuse: max/mean load"} <= set(names)
