"""The routing comparison over several seeds: the summaries across seeds, the targets
judged on their per-seed values' mean, reports read back from JSON, `--seeds` and
`--seeds-from`, and arm settings given to an arm that does not take them."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.report_json import point_dict
from kvflow.loadgen.summary import LoadPointSummary, summarize
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import ArmLadder, ComparisonConfig, ComparisonResult
from kvflow.sim.compare_cli import main
from kvflow.sim.report import report_dict
from kvflow.sim.report_load import ReportError, merge_by_seed, summary_from_dict
from kvflow.sim.seeds import meets, rung_spreads, seed_verdicts, spread, target_key
from kvflow.sim.seeds_report import render_seeds, seeds_report_dict
from kvflow.sim.targets import Verdict

SLO = Slo(ttft_s=1.0, tpot_s=0.1)
SPEC = ClusterSpec(resolve_profile("h100-llama3-8b"))


def point(rate: float, ttft_s: float, hit: float = 0.0) -> LoadPointSummary:
    """Ten requests at ``rate`` over two workers, each with this TTFT and hit rate."""
    records = []
    for i in range(10):
        sent = i / rate
        records.append(RequestRecord(f"r{i}", sent, sent, sent + ttft_s + 0.1,
                                     (sent + ttft_s, sent + ttft_s + 0.1), 2, 100,
                                     round(100 * hit), worker=f"w{i % 2}"))  # fmt: skip
    return summarize(LoadPoint(ArrivalKind.POISSON, rate), records, warmup_s=0.0,
                     offered_rate_per_s=rate, slo=SLO)  # fmt: skip


def result(seed: int, ttfts: dict[str, list[float]], hit: float = 0.5) -> ComparisonResult:
    """A "no-reuse" ladder per arm, one rung per TTFT (10, 20, ... req/s)."""
    config = ComparisonConfig(trace_path="", arms=list(ttfts), workloads=["no-reuse"],
                              slo=SLO, seed=seed, quick=True)  # fmt: skip
    out = ComparisonResult(config, SPEC)
    for arm, values in ttfts.items():
        points = [point(10.0 * (i + 1), t, hit) for i, t in enumerate(values)]
        out.ladders.append(ArmLadder("no-reuse", arm, points, [], 0.0))
    return out


def test_a_spread_is_the_mean_sd_and_range_of_the_measured_seeds() -> None:
    s = spread([1.0, 2.0, 6.0])
    assert (s.mean, s.min, s.max) == (3.0, 1.0, 6.0)
    assert s.sd == pytest.approx(math.sqrt(7.0))
    # A seed with nothing measured is kept per seed and left out of the summary.
    s = spread([1.0, math.nan, 3.0])
    assert s.mean == 2.0 and s.num_values == 2 and math.isnan(s.per_seed[1])
    assert math.isnan(spread([math.nan]).mean) and spread([4.0]).sd == 0.0
    assert spread([0.2, math.inf]).mean == math.inf  # a failed seed is not averaged away


def test_targets_are_parsed_and_names_match_across_seeds() -> None:
    assert meets(1.05, "<= 1.05x") and not meets(1.06, "<= 1.05x")
    assert meets(0.9, ">= 0.9") and not meets(0.89, ">= 0.9") and meets(2.0, ">= 2x")
    assert not meets(math.nan, "<= 1.25") and not meets(math.nan, ">= 0.9")
    with pytest.raises(ValueError):
        meets(1.0, "(no target)")
    assert target_key("TTFT P90 at round-robin's saturation (40 req/s)") == (
        "TTFT P90 at round-robin's saturation"
    )
    assert target_key("mooncake 2x: round-robin's TTFT P90 over ours") == (
        "mooncake 2x: round-robin's TTFT P90 over ours"
    )


def test_a_target_is_judged_on_the_mean_of_each_seeds_value() -> None:
    def v(name: str, value: float, is_met: bool, target: str = "<= 1.1x") -> Verdict:
        return Verdict(name, is_met, value, target, f"detail {value}")

    per_seed = [
        (0, [v("agent: TTFT P90 vs ideal", 1.12, False), v("hits", 0.95, True, ">= 0.9"),
             v("sat (40 req/s)", 12.0, True, ">= 10x")]),
        (1, [v("agent: TTFT P90 vs ideal", 1.03, True), v("hits", 0.86, False, ">= 0.9"),
             v("sat (50 req/s)", 9.0, False, ">= 10x")]),
        (2, [v("agent: TTFT P90 vs ideal", 1.17, False), v("hits", 0.87, False, ">= 0.9")]),
    ]  # fmt: skip
    agent, hits, sat = seed_verdicts(per_seed)
    # Met at one seed of three, missed on the mean (1.107 > 1.10).
    assert agent.value.mean == pytest.approx(1.10666, abs=1e-4)
    assert not agent.is_met_on_mean and agent.met_seeds == 1
    assert (agent.value.min, agent.value.max) == (1.03, 1.17)
    assert agent.details == ("detail 1.12", "detail 1.03", "detail 1.17")
    # Missed at two seeds of three, missed on the mean too (0.893 < 0.9).
    assert not hits.is_met_on_mean and hits.met_seeds == 1
    # The saturation rung differs between seeds: one target, judged where it was judged.
    assert sat.name == "sat" and sat.seeds == (0, 1) and sat.value.mean == 10.5
    assert sat.is_met_on_mean and sat.met_seeds == 1
    info = seed_verdicts([(0, [Verdict("x", True, 1.2, "(no target)", "", is_target=False)])])
    assert not info[0].is_met_on_mean and info[0].met_seeds == 0


def test_rungs_are_summarised_per_workload_arm_and_rung() -> None:
    runs = [
        (0, result(0, {"kvflow": [0.1, 0.3], "least-loaded": [0.2, 0.4]})),
        (1, result(1, {"kvflow": [0.3, 0.5], "least-loaded": [0.2, 2.0]})),
    ]
    rungs = {(r.arm, r.label): r for r in rung_spreads(runs)}
    kv10 = rungs[("kvflow", "10 req/s")].metrics["ttft_p90_s"]
    assert kv10.per_seed == pytest.approx((0.1, 0.3)) and kv10.mean == pytest.approx(0.2)
    assert rungs[("least-loaded", "20 req/s")].metrics["ttft_p90_s"].max == pytest.approx(2.0)
    assert rungs[("kvflow", "20 req/s")].seeds == (0, 1)
    # The report's table and JSON carry the same numbers; JSON has no NaN or infinity.
    text = render_seeds(runs)
    assert "seeds 0, 1" in text and "0.200 (0.100-0.300)" in text
    report = json.loads(json.dumps(seeds_report_dict(runs), allow_nan=False))
    [parity] = [
        t for t in report["targets"] if t["name"] == "no-reuse: TTFT P90 and knee vs least-loaded"
    ]
    # Seed 0: P90 ratios 0.5 and 0.75 under an equal knee (1.0); seed 1: 1.5 at 10 req/s
    # (20 not judged: least-loaded misses the SLO there).
    assert parity["value"]["per_seed"] == pytest.approx([1.0, 1.5])
    assert parity["value"]["mean"] == pytest.approx(1.25) and not parity["is_met_on_mean"]
    assert parity["met_seeds"] == 1
    assert len(report["runs"]) == 2 and report["runs"][1]["config"]["seed"] == 1
    mismatched = result(1, {"kvflow": [0.1], "least-loaded": [0.2]})
    mismatched.ladders[0].points[0] = point(15.0, 0.1)
    with pytest.raises(ValueError, match="ran other rungs"):
        rung_spreads([runs[0], (1, mismatched)])


def test_reports_read_back_from_json_equal_what_was_written(tmp_path: Path) -> None:
    p = point(10.0, 0.25, hit=0.4)
    assert summary_from_dict(json.loads(json.dumps(point_dict(p)))) == p
    # Two files of one seed merge; a file of another seed is another seed.
    a = result(0, {"kvflow": [0.1], "least-loaded": [0.2]})
    b = result(0, {"ideal": [0.1]})
    c = result(1, {"kvflow": [0.3], "least-loaded": [0.2]})
    paths = []
    for name, r in (("a", a), ("b", b), ("c", c)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report_dict(r)))
    out, err = io.StringIO(), io.StringIO()
    code = main(["--seeds-from", *map(str, paths), "--json", str(tmp_path / "s.json")], out, err)
    assert code == 0, err.getvalue()
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["seeds"] == [0, 1]
    arms = {(r["arm"], tuple(r["seeds"])) for r in report["rungs"]}
    assert arms == {("kvflow", (0, 1)), ("least-loaded", (0, 1)), ("ideal", (0,))}
    kv = next(r for r in report["rungs"] if r["arm"] == "kvflow")
    assert kv["metrics"]["ttft_p90_s"]["per_seed"] == pytest.approx([0.1, 0.3])
    # A report over seeds reads back as its seeds' reports.
    code = main(["--seeds-from", str(tmp_path / "s.json"), "--json", str(tmp_path / "t.json")],
                out, err)  # fmt: skip
    assert code == 0, err.getvalue()
    again = json.loads((tmp_path / "t.json").read_text())
    assert again["rungs"] == report["rungs"] and again["targets"] == report["targets"]
    # A report of another cluster, and a file that is no report, are refused.
    other = result(1, {"kvflow": [0.3]})
    other.config = ComparisonConfig(trace_path="", num_workers=4, slo=SLO, seed=1, quick=True)
    with pytest.raises(ReportError, match="disagree"):
        merge_by_seed([a, other])
    (tmp_path / "x.json").write_text("{}")
    code = main(["--seeds-from", str(tmp_path / "x.json")], out, err)
    assert code == 2 and "not a `kvflow sim compare --json` report" in err.getvalue()


def test_seeds_runs_each_seed_as_its_single_seed_run_would(tmp_path: Path) -> None:
    """``--seeds 2`` runs seeds 0 and 1, each arm on that seed's arrivals: seed 1's ladder
    is the one ``--seed 1`` alone gives."""
    common = ["--workloads", "no-reuse", "--quick", "--arms", "least-loaded"]
    out, err = io.StringIO(), io.StringIO()
    code = main([*common, "kvflow", "--seeds", "2", "--json", str(tmp_path / "s.json")], out, err)
    assert code == 0, err.getvalue()
    assert "targets for the default router (kvflow), judged on the mean" in out.getvalue()
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["seeds"] == [0, 1]
    code = main([*common, "--seed", "1", "--json", str(tmp_path / "one.json")], out, err)
    assert code == 0, err.getvalue()
    single = json.loads((tmp_path / "one.json").read_text())["ladders"][0]["load_points"]
    [seed1] = [r for r in report["runs"][1]["ladders"] if r["arm"] == "least-loaded"]
    assert seed1["load_points"] == single
    seed0 = next(r for r in report["runs"][0]["ladders"] if r["arm"] == "least-loaded")
    assert seed0["load_points"] != single  # another seed, other arrivals
    ll = [r for r in report["rungs"] if r["arm"] == "least-loaded"]
    assert [r["metrics"]["ttft_p90_s"]["per_seed"][1] for r in ll] == pytest.approx(
        [p["latency"]["ttft_p90_with_failures_s"] for p in single]
    )


@pytest.mark.parametrize("text", ["0", "1,1", "a,b", "-1,2", "x"])
def test_bad_seeds_exit_2(text: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--seeds", text], io.StringIO(), io.StringIO())
    assert exc.value.code == 2


def test_a_plot_is_of_one_seed() -> None:
    err = io.StringIO()
    assert main(["--seeds", "2", "--plot", "x.png"], io.StringIO(), err) == 2
    assert "--plot draws one seed" in err.getvalue()


def test_a_setting_given_to_an_arm_that_does_not_take_it_names_the_arms_that_do() -> None:
    with pytest.raises(ValueError, match=r"kvflow-blocks does not take the setting "
                       r"'prefill_stall'; the arms that take it: kvflow$"):  # fmt: skip
        resolve_arm("kvflow-blocks:prefill_stall=0.5")
    with pytest.raises(ValueError, match=r"'gate_requests'; the arms that take it: kvflow-b"):
        resolve_arm("kvflow:gate_requests=4")
    with pytest.raises(ValueError, match=r"'gate_s'; the arms that take it: kvflow$"):
        resolve_arm("kvflow-blocks:gate_s=0.2")
    with pytest.raises(ValueError, match=r"'fastest' is neither a setting .* nor a scorer"):
        resolve_arm("kvflow:fastest=1")
    # What each arm takes still resolves.
    resolve_arm("kvflow:prefill_stall=0.5,gate_s=0.2,queue_depth=2")
    resolve_arm("kvflow-blocks:gate_requests=4,gate=off,in_flight_ttl=0")
    err = io.StringIO()
    code = main(["--arms", "kvflow-blocks:prefill_stall=0.5", "--workloads", "no-reuse"],
                io.StringIO(), err)  # fmt: skip
    assert code == 2 and "the arms that take it: kvflow" in err.getvalue()
