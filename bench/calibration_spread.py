"""What error the simulator's step model has on this machine, and how it spreads over runs.

Runs tests/sim/test_calibration.py's fit and check several times, as their own processes
(``kvflow profile`` over the full sweep on the tiny random Llama, CPU clock, one thread;
then ``kvflow sim calibrate``, the same clock), and reports:

- each step-model term (StepTiming's coefficients): mean, standard deviation and
  coefficient of variation over the runs;
- the step model's error per kind of step (decode-only, prefill-only, mixed): median and
  P90 of |predicted - measured| / measured, on the run's own steps and, held out, on the
  other runs' steps (what a profile fitted once predicts for a later run);
- the end-to-end error, the simulator against the real engine: mean TTFT and TPOT (what
  the test checks) and their P50s, per run, with mean, standard deviation and the
  largest magnitude;
- the step drift of each check (its real steps against the fitted step model, median
  ratio minus one): how far the machine moved between the fit and the check.

    .venv/bin/python bench/calibration_spread.py --runs 10 --out bench/data/calibration_spread.json

docs/simulator.md ("How accurate") quotes a run; the test's bound comes from it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from testkit.tiny_model import write_tiny_llama  # noqa: E402

from kvflow.engine_worker.sim.fit import COLUMNS  # noqa: E402

KVFLOW = [sys.executable, "-m", "kvflow.cli.main"]
# The test's settings (tests/sim/test_calibration.py).
PROFILE_ARGS = ["--max-prompt-tokens", "512"]
CALIBRATE_ARGS = ["--rate", "4", "--duration-s", "15", "--warmup-s", "3", "--tolerance", "1"]


def kind(step: dict[str, Any]) -> str:
    if step["num_prefill_seqs"] == 0:
        return "decode"
    return "prefill" if step["num_decode_seqs"] == 0 else "mixed"


def predict(timing: dict[str, float], step: dict[str, Any]) -> float:
    return (
        timing["base_step_s"]
        + timing["per_prefill_token_s"] * step["num_prefill_tokens"]
        + timing["per_decode_seq_s"] * step["num_decode_seqs"]
        + timing["per_kv_token_s"] * step["num_kv_tokens_read"]
        + timing["per_prefill_seq_s"] * step["num_prefill_seqs"]
    )


def step_errors(timing: dict[str, float], steps: list[dict[str, Any]]) -> dict[str, list[float]]:
    errors: dict[str, list[float]] = {"decode": [], "prefill": [], "mixed": [], "all": []}
    for step in steps:
        error = abs(predict(timing, step) - step["seconds"]) / step["seconds"]
        errors[kind(step)].append(error)
        errors["all"].append(error)
    return errors


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def spread(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "sd": sd, "cv": sd / mean if mean else 0.0,
            "max_abs": max(abs(v) for v in values)}  # fmt: skip


def one_run(model: Path, folder: Path, index: int) -> dict[str, Any]:
    profile, samples = folder / f"profile-{index}.json", folder / f"samples-{index}.json"
    fit = subprocess.run([*KVFLOW, "profile", "--model", str(model), "--out", str(profile),
                          "--samples-out", str(samples), *PROFILE_ARGS],
                         capture_output=True, text=True, check=True)  # fmt: skip
    fitted = json.loads(profile.read_text())
    check = subprocess.run([*KVFLOW, "sim", "calibrate", "--profile", str(profile),
                            "--model", str(model), *CALIBRATE_ARGS],
                           capture_output=True, text=True, check=False)  # fmt: skip
    found = re.search(r"TTFT ([-+0-9.]+)%, TPOT ([-+0-9.]+)%", check.stdout)
    drift = re.search(r"step drift: the real engine's steps ran ([-+0-9.]+)%", check.stdout)
    means = re.search(r"error in the mean: TTFT ([-+0-9.]+)%, TPOT ([-+0-9.]+)%", check.stdout)
    assert found and drift and means, fit.stderr + check.stdout + check.stderr
    return {
        "timing": fitted["timing"],
        "source": fitted["source"],
        "steps": json.loads(samples.read_text()),
        "ttft_p50_error": float(found.group(1)) / 100,
        "tpot_p50_error": float(found.group(2)) / 100,
        "ttft_mean_error": float(means.group(1)) / 100,
        "tpot_mean_error": float(means.group(2)) / 100,
        "step_drift": float(drift.group(1)) / 100,
        "calibrate": check.stdout,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    terms = {c: spread([r["timing"][c] for r in runs]) for c in COLUMNS}
    own: dict[str, list[float]] = {}
    held_out: dict[str, list[float]] = {}
    for i, run in enumerate(runs):
        for name, errors in step_errors(run["timing"], run["steps"]).items():
            own.setdefault(name, []).extend(errors)
        for j, other in enumerate(runs):
            if i != j:
                for name, errors in step_errors(run["timing"], other["steps"]).items():
                    held_out.setdefault(name, []).extend(errors)
    steps = {
        name: {
            "num_steps": len(own[name]) // len(runs),
            "own_p50": quantile(own[name], 0.5),
            "own_p90": quantile(own[name], 0.9),
            "held_out_p50": quantile(held_out.get(name, []), 0.5),
            "held_out_p90": quantile(held_out.get(name, []), 0.9),
        }
        for name in own
    }
    return {
        "runs": len(runs),
        "terms": terms,
        "step_error_by_kind": steps,
        "ttft_p50_error": spread([r["ttft_p50_error"] for r in runs]),
        "tpot_p50_error": spread([r["tpot_p50_error"] for r in runs]),
        "ttft_mean_error": spread([r["ttft_mean_error"] for r in runs]),
        "tpot_mean_error": spread([r["tpot_mean_error"] for r in runs]),
        "step_drift": spread([r["step_drift"] for r in runs]),
        "per_run": [
            {
                "ttft_p50_error": r["ttft_p50_error"],
                "tpot_p50_error": r["tpot_p50_error"],
                "ttft_mean_error": r["ttft_mean_error"],
                "tpot_mean_error": r["tpot_mean_error"],
                "step_drift": r["step_drift"],
                "source": r["source"],
            }
            for r in runs
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = write_tiny_llama(folder / "tiny", seed=0)
        runs = []
        for i in range(args.runs):
            runs.append(one_run(model, folder, i))
            last = runs[-1]
            print(f"run {i + 1}: TTFT {last['ttft_p50_error']:+.1%} TPOT "
                  f"{last['tpot_p50_error']:+.1%}; mean TTFT {last['ttft_mean_error']:+.1%} "
                  f"TPOT {last['tpot_mean_error']:+.1%}; step drift {last['step_drift']:+.1%}; "
                  f"{last['source']}", flush=True)  # fmt: skip
    summary = summarize(runs)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
