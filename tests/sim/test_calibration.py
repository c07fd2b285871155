"""`kvflow profile` fits the real engine, and the simulator then predicts it (issue 8's
calibration check, on the tiny random Llama; docs/simulator.md has the SmolLM2 run).

Both sides keep CPU time (the default clock): the engine's steps are timed by this
thread's CPU time, so the machine's other jobs move the numbers less than they move the
wall clock, but still some (shared caches and memory bandwidth): on the 2-core CI machine
at load 5-9, two runs of this test measured TTFT errors of +13 % and -27 %. CI holds the
machinery and a sane fit to 35 %; the 15 % check is docs/simulator.md's quiet-machine run.

The fit and the real run are a minute apart, and the VM's cores are shared with other
machines: a clean-clone CI run with nothing else on this machine measured the real engine
at twice the fitted step time (TTFT -47 %, TPOT -47 %: every step slower alike, as when the
host gets busier between the two halves). So a miss is measured again once, fit and run
both; a simulator that is wrong misses twice.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.cli.sim.cli import main as sim_main
from kvflow.engine_worker.sim.profile_cli import main as profile_main


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_a_fitted_profile_predicts_the_real_engine(tmp_path: Path, one_thread: None) -> None:
    model = write_tiny_llama(tmp_path / "tiny", seed=0)
    misses = []
    for attempt in range(2):
        code, report = _fit_and_calibrate(model, tmp_path / f"tiny-{attempt}.json")
        assert "simulator error at P50" in report, report
        if code == 0:
            break
        misses.append(report)
    assert code == 0, "\n".join(misses)


def _fit_and_calibrate(model: Path, profile: Path) -> tuple[int, str]:
    assert profile_main(["--model", str(model), "--out", str(profile), "--quick",
                         "--max-prompt-tokens", "512"]) == 0  # fmt: skip
    fitted = json.loads(profile.read_text())
    # 16 tokens x (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes.
    assert fitted["kv_bytes_per_block"] == 16 * 2 * 2 * 2 * 16 * 4
    r_squared = float(re.search(r"R\^2 ([0-9.]+)", fitted["source"]).group(1))  # type: ignore[union-attr]
    assert r_squared > 0.9, fitted["source"]
    out, err = io.StringIO(), io.StringIO()
    code = sim_main(["calibrate", "--profile", str(profile), "--model", str(model),
                     "--rate", "4", "--duration-s", "15", "--warmup-s", "3",
                     "--tolerance", "0.35"], out, err)  # fmt: skip
    return code, out.getvalue() + err.getvalue()
