"""`kvflow profile` fits the real engine, and the simulator then predicts it (issue 8's
calibration check, on the tiny random Llama; docs/simulator.md has the SmolLM2 run).

One clock on both sides: the profile is fitted with `--clock cpu` (each step of the sweep
timed by the engine thread's CPU time, one torch thread), and `kvflow sim calibrate
--clock cpu` runs the real engine on the same clock (its time advances by each step's CPU
time and jumps idle gaps to the next arrival), against the simulator's virtual time. The
machine's other jobs then change what a step costs (caches, memory bandwidth) but not
whether a waiting step counts.

What error the model has, measured by bench/calibration_spread.py (10 runs of this test's
fit and check, each a fresh fit, on the 2-core test machine at load average 1-2;
bench/data/calibration_spread.json):

- the terms over the runs (mean, sd): base step 0.94 +- 0.31 ms (CV 33 %); per prefill
  token 6.33 +- 0.71 us (11 %); per decoding sequence 4.64 +- 0.05 ms (1 %); per prefill
  sequence 4.41 +- 0.09 ms (2 %); per KV token read 0.011 +- 0.023 us (the tiny model's
  attention reads are lost in its per-sequence cost: not identified here, and its error
  does not matter here either);
- the step model, |predicted - measured| / measured: median 5.5 % (P90 11 %) on the run's
  own steps, 6.2 % (P90 12 %) held out on the other runs' steps; by kind of step, held out:
  decode 5.8 % (P90 11 %), prefill 8.3 % (P90 20 %), mixed 7.6 % (P90 15 %);
- the check's own steps against the fit (the step drift: how far the machine moved between
  fit and check): -0.6 % mean, sd 5.5 points, at most 12.1 % off;
- end to end, the simulator's mean TTFT against the real engine's: -4.2 %, sd 6.5 points,
  at most 14.2 % off; mean TPOT +1.4 %, sd 6.6 points, at most 11.2 % off.

The test compares means, not P50s. Over the same 10 runs the TTFT P50 error ran from
-55 % to +32 % (sd 29 points) and the TPOT P50's from -23 % to +20 %: at this load an
arrival either finds the engine idle (its TTFT is its prefill step, about 6 ms) or waits
out a running step (about 12 ms), and the P50 of 58 requests falls on one mode or the
other (the run that failed in CI: real 12.2 ms, simulated 5.7 ms). A mean moves with the
share of arrivals that wait, smoothly.

The bounds are |mean| + 3 sd of those runs, rounded up to 5 points: mean TTFT and mean
TPOT within 25 %, one try. The test is marked `alone` (`make test` runs it after the
parallel run): in the parallel run, the other worker's load changed between the fit and
the check, and the engine's steps ran 28 % slower than fitted (both halves take CPU time,
and a busy sibling core slows a thread's CPU time too). A simulator wrong in kind fails
by far: with the fitted profile's per-decoding-sequence term 1.3x too large, the mean TTFT
error was +51 % and TPOT's +67 %; with every term 1.3x, +73 % and +76 % (the same fit
unchanged: -8 % and -5 %). The fit's R^2 was
0.98-0.99; below 0.8 the sweep itself went wrong.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.tiny_model import write_tiny_llama

KVFLOW = [sys.executable, "-m", "kvflow.cli.main"]
TTFT_MEAN_BOUND = 0.25
TPOT_MEAN_BOUND = 0.25
MIN_R_SQUARED = 0.8


@pytest.mark.slow
@pytest.mark.alone  # the fit and the check each time steps: both need the same quiet machine
def test_a_fitted_profile_predicts_the_real_engine(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "tiny", seed=0)
    profile = tmp_path / "tiny.json"
    fit = _kvflow("profile", "--model", str(model), "--out", str(profile), "--clock", "cpu",
                  "--threads", "1", "--max-prompt-tokens", "512")  # fmt: skip
    assert fit.returncode == 0, fit.stderr
    fitted = json.loads(profile.read_text())
    # 16 tokens x (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes.
    assert fitted["kv_bytes_per_block"] == 16 * 2 * 2 * 2 * 16 * 4
    assert "cpu clock" in fitted["source"], fitted["source"]
    r_squared = float(re.search(r"R\^2 ([0-9.]+)", fitted["source"]).group(1))  # type: ignore[union-attr]
    run = _kvflow("sim", "calibrate", "--profile", str(profile), "--model", str(model),
                  "--clock", "cpu", "--threads", "1", "--rate", "4", "--duration-s", "15",
                  "--warmup-s", "3", "--tolerance", "1")  # fmt: skip
    assert run.returncode in (0, 1), run.stderr
    report = fitted["source"] + "\n" + run.stdout + _machine_state()
    errors = re.search(r"error in the mean: TTFT ([-+0-9.]+)%, TPOT ([-+0-9.]+)%", run.stdout)
    assert errors, report
    ttft_error, tpot_error = float(errors.group(1)) / 100, float(errors.group(2)) / 100
    assert r_squared > MIN_R_SQUARED, report
    assert abs(ttft_error) <= TTFT_MEAN_BOUND, report
    assert abs(tpot_error) <= TPOT_MEAN_BOUND, report


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVFLOW, *args], check=False, capture_output=True, text=True, timeout=600
    )


def _machine_state() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ps = ["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"]
    top = subprocess.run(ps, check=False, capture_output=True, text=True).stdout.splitlines()
    return f"load average {load}; busiest processes:\n" + "\n".join(x[:160] for x in top[:6]) + "\n"
