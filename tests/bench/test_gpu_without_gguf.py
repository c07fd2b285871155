"""The device script's imports on an image without ``gguf`` (issue 34).

The GPU machine has torch and transformers and no ``gguf``; its wheel cannot be fetched
there. The loader imports ``gguf`` only when a GGUF file is loaded, so every GPU test file
(``bench/gpu_tests.sh --list``) and the GPU check's engine and model builders must import,
build a random-weight model and step an engine with ``gguf`` absent.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from testkit.device_image import env_without

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ["tests", "bench", "proto", "engine_worker"]

BUILD = """
import importlib.util, sys, tempfile
from pathlib import Path
assert importlib.util.find_spec("gguf") is None, "gguf is meant to be absent here"
import torch
from kvflow.engine_worker.model.loader import load_model
from testkit.tiny_model import write_tiny_llama
from gpu.models import engine_config, kvflow_random, make_engine, run_engine
from gpu.shapes import SHAPES
folder = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")
model, config = load_model(folder, dtype=torch.float32, device="cpu")
config = engine_config(SHAPES["tiny"], "tiny")
model = kvflow_random(config, torch.float32, "cpu", seed=0)
built = make_engine(model, config, dtype=torch.float32, device="cpu", num_blocks=16,
                    max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
run = run_engine(built.engine, [[5, 6, 7], [8, 9]], [3, 3])
assert all(len(t) == 3 for t in run.tokens.values()), run.tokens
print("built", sorted(m for m in sys.modules if m.startswith("kvflow.engine_worker.model")))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    env = env_without(tmp_path, "gguf")
    env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], *(str(ROOT / r) for r in ROOTS)])
    return env


def test_the_loader_builds_and_steps_a_model_without_gguf(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BUILD],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvflow.engine_worker.model.loader" in proc.stdout


@pytest.mark.slow
def test_the_gpu_test_files_collect_without_gguf(tmp_path: Path) -> None:
    files = subprocess.run(
        ["bash", "bench/gpu_tests.sh", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert files and all((ROOT / f).is_file() for f in files), files
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
         "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    # Every file contributes its gpu tests: none failed to import.
    assert {c.split("::")[0] for c in collected} == set(files), proc.stdout[-3000:]
