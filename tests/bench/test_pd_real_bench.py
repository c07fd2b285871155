"""bench/pd_real.py end to end, as a smoke: real workers (a tiny random Llama with
SmolLM2's vocabulary, so it runs in seconds), real gateways, the three arms and the
threshold sweep. It checks that the JSON is complete and that each arm really ran the
plan it claims (the gateways' own counters), never speed: a benchmark is not a test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from testkit.tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

from pd_real_traffic import Kind, Traffic, requests_for, schedule  # noqa: E402

ARMS = ("colocated", "always-pd", "policy")
MEASURE_S = 4.0
SWEEP_SIZES = (64, 512)


def test_every_arm_of_a_repetition_gets_the_same_schedule_and_its_own_text() -> None:
    traffic = Traffic(0.5, (24, 64), 32, 6.0, (300, 600), 8, 2.0, 10.0, 5.0)
    first, again = schedule(traffic, 0, 0), schedule(traffic, 0, 0)
    assert first == again and first != schedule(traffic, 0, 1)
    longs = [a for a in first if a.kind is Kind.LONG]
    assert [a.offset_s for a in longs] == [3.0, 9.0, 15.0]  # every 6 s, half a period in
    assert all(300 <= a.num_prompt_tokens <= 600 for a in longs)
    a, b = requests_for(first, "colocated/0"), requests_for(first, "policy/0")
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert a[0].namespace != b[0].namespace  # no arm warms another's cache


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("pd-real")
    model = write_tiny_llama(tmp / "tiny", seed=0)
    out = tmp / "pd.json"
    proc = subprocess.run(
        [sys.executable, "bench/pd_real.py", "--quick", "--model", str(model),
         "--measure-s", str(MEASURE_S), "--json", str(out)],
        cwd=ROOT, check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio to colocated" in proc.stdout and "threshold sweep" in proc.stdout
    return dict(json.loads(out.read_text()))


def _decisions(run: dict[str, Any]) -> dict[str, float]:
    prefix = "kvflow_router_pd_decisions_total"
    return {k[len(prefix) :]: v for k, v in run["pd_counters"].items() if k.startswith(prefix)}


@pytest.mark.integration
@pytest.mark.slow
def test_each_arm_ran_once_with_every_measured_request_answered(report: dict[str, Any]) -> None:
    assert report["schema"] == "kvflow-pd-real/1"
    traffic = Traffic(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in report["config"]["traffic"].items()})  # fmt: skip
    assert traffic.measure_s == MEASURE_S
    expected = {k: 0 for k in Kind}
    for arrival in schedule(traffic, report["config"]["seed"], 0):
        if traffic.warmup_s <= arrival.offset_s < traffic.horizon_s:
            expected[arrival.kind] += 1
    assert expected[Kind.STREAM] > 0 and expected[Kind.LONG] > 0
    assert [r["arm"] for r in report["runs"]] == list(ARMS)
    for run in report["runs"]:
        summary = run["summary"]
        assert summary["errors"] == {}, summary["error_examples"]
        assert summary["num_measured"] == {k.value: n for k, n in expected.items()}
        measured = [r for r in run["records"]
                    if traffic.warmup_s <= r["scheduled_s"] < traffic.horizon_s]  # fmt: skip
        streams = [r for r in measured if r["request_id"].startswith("stream-")]
        assert {r["num_output_tokens"] for r in streams} == {traffic.stream_output_tokens}
        # A chunk may carry several tokens (or none: part of a character), so no exact count.
        assert summary["streams"]["itl_s"]["count"] > len(streams)
        assert summary["schedule"]["lag_s"]["count"] == sum(expected.values())
        assert run["valid"] == (not run["problems"])
        cpu = run["cpu"]
        assert set(cpu["process_cpu_s"]) == {*report["config"]["arms"][ARMS.index(run["arm"])]
                                             ["workers"], "gateway", "client"}  # fmt: skip
        assert all(v >= 0 for v in cpu["process_cpu_s"].values())
        assert cpu["machine_busy_cpu_s"] >= 0 and len(cpu["load_avg_1m"]) == 2


@pytest.mark.integration
@pytest.mark.slow
def test_each_arm_ran_the_plans_it_claims(report: dict[str, Any]) -> None:
    by_arm = {r["arm"]: _decisions(r) for r in report["runs"]}
    assert set(by_arm["colocated"]) == {"{decision=colocated,reason=colocated_worker}"}
    # Streams are 24-64 tokens: more than one block, so `always` ships every prompt.
    assert set(by_arm["always-pd"]) == {"{decision=disaggregated,reason=many_missing_tokens}"}
    # The default threshold (512) keeps streams local and ships the 600-900-token prompts.
    assert set(by_arm["policy"]) == {"{decision=disaggregated,reason=many_missing_tokens}",
                                     "{decision=colocated,reason=few_missing_tokens}"}  # fmt: skip
    [point] = report["load_points"]
    assert point["stream_rate_per_s"] == report["config"]["traffic"]["stream_rate_per_s"]
    arms = point["arms"]
    assert arms["colocated"]["disaggregated_share"] == 0.0
    assert arms["always-pd"]["disaggregated_share"] == 1.0
    assert 0.0 < arms["policy"]["disaggregated_share"] < 1.0
    for name in ARMS:
        assert arms[name]["num_runs"] == 1
        ratios = arms[name]["vs_colocated"]
        if arms[name]["num_valid_runs"] and arms["colocated"]["num_valid_runs"]:
            assert all(v is not None and v > 0 for v in ratios.values()), ratios
    assert set(arms["colocated"]["vs_colocated"].values()) <= {1.0, None}


@pytest.mark.integration
@pytest.mark.slow
def test_the_threshold_sweep_compares_both_paths_at_each_size(report: dict[str, Any]) -> None:
    sweep = report["threshold_sweep"]
    assert [row["prompt_tokens"] for row in sweep["rows"]] == list(SWEEP_SIZES)
    for row in sweep["rows"]:
        assert row["reported_prompt_tokens"] == [row["prompt_tokens"]]  # one word, one token
        pd, local = row["pd"], row["local"]
        assert pd["errors"] == [] and local["errors"] == []
        assert pd["num_disaggregated"] == 1 and local["num_disaggregated"] == 0
        assert pd["ttft_s"] > 0 and local["ttft_s"] > 0
        assert row["pd_over_local"] == pytest.approx(pd["ttft_s"] / local["ttft_s"], abs=1e-3)
