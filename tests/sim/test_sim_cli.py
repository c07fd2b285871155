"""`kvflow sim run` (the bench's options in virtual time), option errors, `kvflow bench sim`."""

from __future__ import annotations

import io
import json
from pathlib import Path

from kvflow.cli.bench import main as bench_main
from kvflow.cli.sim import main
from kvflow.engine_worker.sim.profile_file import write_profile
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.proto.step_model import StepTiming

SMALL_RUN = ["--workload", "shared-prefix", "--groups", "3", "--prefix-words", "128",
             "--question-words", "16", "--output-tokens", "4", "--rates", "4,8",
             "--duration-s", "5", "--warmup-s", "1", "--workers", "2", "--quiet"]  # fmt: skip


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out, err)
    return code, out.getvalue(), err.getvalue()


def profile_file(tmp_path: Path) -> str:
    path = tmp_path / "p.json"
    timing = StepTiming(base_step_s=0.01, per_prefill_token_s=2e-4, per_decode_seq_s=1e-3)
    write_profile(SimProfile("test", timing, 16, 1024, 512, 1024, 32, 1e9, "test"), path)
    return str(path)


def test_bench_options_in_virtual_time(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, err = run(["run", *SMALL_RUN, "--profile", profile_file(tmp_path),
                          "--arms", "kvflow", "round-robin",
                          "--json", str(out_json), "--plot", str(out_png)])  # fmt: skip
    assert code == 0, err
    assert "== kvflow: shared-prefix on 2 x test" in out
    assert "== round-robin" in out and "knee:" in out
    report = json.loads(out_json.read_text())
    assert set(report) == {"kvflow", "round-robin"}
    points = report["kvflow"]["load_points"]
    assert [p["label"] for p in points] == ["4 req/s", "8 req/s"]
    assert all(p["schedule"]["is_valid"] for p in points)  # virtual time never lags
    assert points[0]["cache"]["hit_rate"] > 0.5  # 3 groups' 128-word prefixes, 16-word questions
    assert out_png.stat().st_size > 10_000
    # Where each measured request went by its prefix: the router's own account. The
    # baselines' scorers report no prefix measures, so round-robin has none.
    for point in points:
        outcomes = point["cache"]["prefix_outcomes"]
        assert sum(outcomes.values()) == point["throughput"]["num_ok"]
        assert outcomes["best_holder"] > outcomes.get("no_prefix", 0)
    assert all(not p["cache"]["prefix_outcomes"] for p in report["round-robin"]["load_points"])


def test_kvflow_bench_sim_is_the_same_command(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = bench_main(["sim", *SMALL_RUN, "--profile", profile_file(tmp_path)], out, err)
    assert code == 0, err.getvalue()
    assert "== kvflow: shared-prefix" in out.getvalue()


def test_bad_options_exit_2_with_the_reason(tmp_path: Path) -> None:
    code, _, err = run(["run", *SMALL_RUN, "--profile", "a100-llama3-8b"])
    assert code == 2 and "unknown profile 'a100-llama3-8b'" in err
    code, _, err = run(["run", "--users", "4", "--profile", profile_file(tmp_path)])
    assert code == 2 and "open-loop" in err
    code, _, err = run(["run", *SMALL_RUN, "--arms", "fastest"])
    assert code == 2 and "unknown arm 'fastest'" in err
    code, _, err = run(["compare", "--trace", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "cannot read trace" in err
    code, _, err = run(["nothing"])
    assert code == 2 and "unknown subcommand" in err
