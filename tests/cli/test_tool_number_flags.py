"""`kvflow plan`, `kvflow bench` and `kvflow sim ...` refuse NaN, infinity and numbers out of
range with an error naming the flag and exit 2 (the installed `kvflow` in a subprocess).
Before, `value <= 0` let NaN and infinity through: `plan --rate nan` and `bench --users 1e400`
ended in tracebacks ("cannot convert float NaN to integer", an OverflowError), `plan
--step-overhead-ms 1e400` divided by zero, `plan --kv-link-gb-s nan` printed a plan, `sim
overload --calm-before-s -1` dropped the phase without a word and `--overload-s inf` never
ended, and `sim compare --num-kv-blocks -1` failed with a traceback from the block pool.
The SLO planner benchmark (`python -m kvflow.sim.autoscale_cli`) the same: `--peak-rate nan`
and `--utilization nan 0.5` ended in "cannot convert float NaN to integer", `--jobs 0` and
`--max-replicas 0` in tracebacks, and `--startups nan` or `--planner-interval 0` ran."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVFLOW = Path(sys.executable).parent / "kvflow"  # the console script `pip install` made
PLAN = ["plan", "--model", "llama-3-8b", "--gpu", "h100"]
BENCH = ["bench", "--url", "http://127.0.0.1:9", "--duration-s", "1"]


AUTOSCALE = ["-m", "kvflow.sim.autoscale_cli", "--quick", "--shapes", "step"]


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``kvflow ARGV``, or ``python -m ...`` for an ``argv`` that starts with ``-m``."""
    command = [sys.executable] if argv[0] == "-m" else [str(KVFLOW)]
    return subprocess.run([*command, *argv], capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


PLAN_CASES = [
    ([*PLAN, "--rate", "nan"], "--rate must be > 0 requests per second, got nan"),
    ([*PLAN, "--rate", "1e400"], "--rate must be > 0 requests per second, got inf"),
    ([*PLAN, "--ttft-ms", "nan"], "--ttft-ms must be > 0"),
    ([*PLAN, "--tpot-ms", "inf"], "--tpot-ms must be > 0"),
    ([*PLAN, "--overhead-gb", "nan"], "--overhead-gb and --step-overhead-ms must be >= 0"),
    ([*PLAN, "--step-overhead-ms", "1e400"], "--step-overhead-ms must be >= 0"),
    ([*PLAN, "--kv-link-gb-s", "nan"], "--kv-link-gb-s must be > 0, got nan"),
    ([*PLAN, "--gpu-price-per-hour", "inf"], "--gpu-price-per-hour must be > 0"),
    ([*PLAN, "--max-context", "4096"], "--model and --max-context both describe the model"),
    (["plan", "--gpu", "h100", "--params-b", "nan", "--layers", "32", "--heads", "32",
      "--kv-heads", "8", "--head-dim", "128"], "--params-b must be > 0"),
    (["plan", "--gpu", "h100", "--params-b", "8", "--layers", "32", "--heads", "32",
      "--kv-heads", "8", "--head-dim", "128", "--max-context", "0"],
     "--max-context must be >= 1 token, got 0"),
]  # fmt: skip
TOOL_CASES = [
    ([*BENCH, "--users", "1e400"], "argument --users: expected positive numbers"),
    ([*BENCH, "--prefix-words", "nan"], "argument --prefix-words: expected positive numbers"),
    ([*BENCH, "--rates", "inf"], "argument --rates: expected positive numbers"),
    ([*BENCH, "--input-scale", "nan"], "--input-scale and --output-scale must be > 0"),
    ([*BENCH, "--warmup-s", "inf"], "--warmup-s must be >= 0"),
    ([*BENCH, "--request-timeout-s", "nan"], "--request-timeout-s and --max-lag-ms must be"),
    ([*BENCH, "--slo-ttft-ms", "inf"], "--slo-ttft-ms and --slo-tpot-ms must be > 0"),
    (["sim", "run", "--rates", "1", "--output-scale", "inf"],
     "--input-scale and --output-scale must be > 0"),
    (["sim", "run", "--rates", "1", "--workers", "0"],
     "argument --workers: must be an integer"),
    (["sim", "compare", "--num-kv-blocks", "-1"],
     "argument --num-kv-blocks: must be an integer >= 1"),
    (["sim", "compare", "--slo-ttft-ms", "nan"],
     "argument --slo-ttft-ms: must be a number of ms > 0"),
    (["sim", "overload", "--calm-before-s", "-1"],
     "argument --calm-before-s: must be a number of seconds >= 0"),
    (["sim", "overload", "--overload-s", "inf"],
     "argument --overload-s: must be a number of seconds"),
    (["sim", "overload", "--overload-load", "nan"],
     "argument --overload-load: must be a number of x capacity > 0"),
    (["sim", "overload", "--capacity-per-s", "nan"],
     "argument --capacity-per-s: must be a number"),
    (["sim", "overload", "--window-s", "0"],
     "argument --window-s: must be a number of seconds > 0"),
    (["sim", "cascade", "--rate-rps", "nan"],
     "argument --rate-rps: must be a number of requests/s"),
    (["sim", "cascade", "--hard-share", "nan"], "--hard-share must be in [0, 1]"),
    (["sim", "batch-day", "--planner-in-flight", "0"],
     "argument --planner-in-flight: must be an integer >= 1"),
    (["sim", "calibrate", "--profile", "x.json", "--rate", "inf"],
     "argument --rate: must be a number of requests/s > 0"),
    ([*AUTOSCALE, "--peak-rate", "nan"], "argument --peak-rate: must be a number of requests"),
    ([*AUTOSCALE, "--slo-tpot-ms", "-1"], "argument --slo-tpot-ms: must be a number of ms"),
    ([*AUTOSCALE, "--utilization", "nan", "0.5"], "argument --utilization: must be a fraction"),
    ([*AUTOSCALE, "--utilization", "0.5", "0.7"], "--utilization: DOWN (0.7) must be under UP"),
    ([*AUTOSCALE, "--startups", "nan"], "argument --startups: must be a number of seconds >= 0"),
    ([*AUTOSCALE, "--planner-interval", "0"], "argument --planner-interval: must be a number"),
    ([*AUTOSCALE, "--max-replicas", "0"], "argument --max-replicas: must be an integer >= 1"),
    ([*AUTOSCALE, "--jobs", "0"], "argument --jobs: must be an integer >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "says"), PLAN_CASES + TOOL_CASES)
def test_nan_infinity_and_out_of_range_are_refused(argv: list[str], says: str) -> None:
    done = run(argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
