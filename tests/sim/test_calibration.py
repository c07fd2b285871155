"""`kvflow profile` fits the real engine, and the simulator then predicts it (issue 8's
calibration check, on the tiny random Llama; docs/simulator.md has the SmolLM2 run).

One clock on both sides: the profile is fitted with `--clock cpu` (each step of the sweep
timed by the engine thread's CPU time, one torch thread), and `kvflow sim calibrate
--clock cpu` runs the real engine on the same clock (its time advances by each step's CPU
time and jumps idle gaps to the next arrival), against the simulator's virtual time. The
machine's other jobs then change what a step costs (caches, memory bandwidth) but not
whether a waiting step counts.

What error the model has, measured by bench/calibration_spread.py (5 runs of this test's
fit and check, each a fresh fit; load average 9-12 on the 2-core test machine;
bench/data/calibration_spread.json):

- the terms over the runs (mean, sd): base step 3.41 +- 0.51 ms (CV 15 %); per prefill
  token 7.60 +- 0.56 us (7 %); per decoding sequence 4.83 +- 0.13 ms (3 %); per prefill
  sequence 4.82 +- 0.27 ms (6 %); per KV token read fitted to 0 in 4 of 5 runs (the tiny
  model's attention reads are lost in its per-sequence cost: this term is not identified
  here, and its error does not matter here either);
- the step model, |predicted - measured| / measured: median 5.4 % (P90 11 %) on the run's
  own steps, 7.2 % (P90 16 %) held out on the other runs' steps; by kind of step, held out:
  decode 7.2 % (P90 15 %), prefill 8.5 % (P90 24 %), mixed 7.0 % (P90 17 %);
- end to end, the simulator's P50 against the real engine's: TTFT +1.7 % mean, sd 12.1
  points, at most 16.4 % off; TPOT -4.3 % mean, sd 5.1 points, at most 11.4 % off. TTFT
  spreads more: it rests on the prefill steps, the sweep's fewest (18 of 341) and its
  least certain, and queueing behind a prefill amplifies their error.

The bounds are |mean| + 3 sd of those runs, rounded up to 5 points: TTFT 40 %, TPOT 20 %,
one try. The test is marked `alone` (`make test` runs it after the parallel run): in the
parallel run, the other worker's load changed between the fit and the check, and the
engine's steps ran 28 % slower than fitted (TPOT -28.5 %; both halves take CPU time, and
a busy sibling core slows a thread's CPU time too). A simulator wrong in kind (a step 1.6x
too slow gave +435 % to +1,345 %) fails by far. The fit's R^2 was 0.87-0.99; below 0.8 the
sweep itself went wrong.
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
TTFT_BOUND = 0.40
TPOT_BOUND = 0.20
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
    errors = re.search(r"TTFT ([-+0-9.]+)%, TPOT ([-+0-9.]+)%", run.stdout)
    assert errors, report
    ttft_error, tpot_error = float(errors.group(1)) / 100, float(errors.group(2)) / 100
    assert r_squared > MIN_R_SQUARED, report
    assert abs(ttft_error) <= TTFT_BOUND, report
    assert abs(tpot_error) <= TPOT_BOUND, report


def _kvflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVFLOW, *args], check=False, capture_output=True, text=True, timeout=600
    )


def _machine_state() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    ps = ["ps", "-eo", "pcpu,etimes,args", "--sort=-pcpu"]
    top = subprocess.run(ps, check=False, capture_output=True, text=True).stdout.splitlines()
    return f"load average {load}; busiest processes:\n" + "\n".join(x[:160] for x in top[:6]) + "\n"
