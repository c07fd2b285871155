"""`--dtype auto`, the default: the checkpoint's own dtype where the device computes it
natively, else float32.

The choice is pure, so every kind of machine is checked here on this one; then a worker's
own process is checked to apply what its checkpoint and this machine's /proc/cpuinfo say.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.tiny_model import write_tiny_llama
from testkit.worker_process import launch_worker

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.auto_dtype import checkpoint_dtype, choose_dtype, cpu_flags, machine_dtype
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings, parse_args

# An AMD EPYC's line (abridged), as on the VMs this project runs on, and an older Xeon's.
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\nbogomips\t: 4800\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"


def bf16_checkpoint(tmp_path: Path) -> Path:
    """A tiny Llama whose config.json says bfloat16, as published checkpoints' do."""
    folder = write_tiny_llama(tmp_path / "tiny", seed=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return folder


def test_the_default_is_auto_on_the_command_line_and_in_process() -> None:
    assert WorkerSettings().dtype == "auto"
    assert parse_args([]).dtype == "auto"
    assert parse_args(["--dtype", "float32"]).dtype == "float32"
    with pytest.raises(SystemExit):  # argparse's usage error: the engine runs no float16
        parse_args(["--dtype", "float16"])


@pytest.mark.parametrize(
    ("checkpoint", "cpuinfo", "device", "cuda_bf16", "expected"),
    [
        ("bfloat16", EPYC, "cpu", False, "bfloat16"),
        ("bfloat16", SAPPHIRE_RAPIDS, "cpu", False, "bfloat16"),
        ("float16", EPYC, "cpu", False, "bfloat16"),  # the engine runs no float16
        ("bfloat16", SKYLAKE, "cpu", False, "float32"),  # bf16 GEMMs would be emulated
        ("bfloat16", "", "cpu", False, "float32"),  # no flags line (ARM, some containers)
        ("bfloat16", SKYLAKE, "cuda", True, "bfloat16"),  # the GPU decides, not the host
        ("bfloat16", EPYC, "cuda:1", False, "float32"),  # a V100 or T4
        ("float32", EPYC, "cpu", False, "float32"),
        ("float32", EPYC, "cuda", True, "float32"),
        ("gguf", EPYC, "cpu", False, "float32"),  # as llama.cpp computes
        ("gguf", SKYLAKE, "cuda", True, "float32"),
    ],
)
def test_auto_runs_the_checkpoints_dtype_where_the_device_has_it(
    checkpoint: str, cpuinfo: str, device: str, cuda_bf16: bool, expected: str
) -> None:
    flags = cpu_flags(cpuinfo)
    dtype, why = choose_dtype(
        "auto", device, checkpoint=checkpoint, cpu_flags=flags, cuda_bf16=cuda_bf16
    )
    assert dtype == expected
    assert why.startswith("auto: ")


@pytest.mark.parametrize("asked", ["float32", "bfloat16"])
def test_an_explicit_dtype_is_kept_on_any_machine(asked: str) -> None:
    for device in ("cpu", "cuda"):
        for checkpoint in ("gguf", "float32", "bfloat16"):
            for flags, cuda_bf16 in ((cpu_flags(EPYC), True), (frozenset(), False)):
                got = choose_dtype(
                    asked, device, checkpoint=checkpoint, cpu_flags=flags, cuda_bf16=cuda_bf16
                )
                assert got == (asked, "as asked")


def test_the_checkpoints_dtype_comes_from_its_config(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "tiny", seed=5)
    assert checkpoint_dtype(str(folder)) == "float32"  # what write_tiny_llama declares
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(str(folder)) == "bfloat16"
    del config["torch_dtype"]
    config["dtype"] = "bfloat16"  # transformers 5 writes this key
    (folder / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(str(folder)) == "bfloat16"
    assert checkpoint_dtype(None) == "gguf"  # the built-in model
    assert checkpoint_dtype(str(tmp_path / "model.gguf")) == "gguf"


def test_an_engine_over_loaded_weights_takes_their_dtype(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny", seed=5)
    for dtype in (torch.float32, torch.bfloat16):
        loaded: Any = load_model(path, dtype=dtype)
        worker = build_worker(WorkerSettings(model=str(path), num_kv_blocks=16), loaded=loaded)
        assert worker.runner.kv_layout.endswith("/" + str(dtype).removeprefix("torch."))
    with pytest.raises(ValueError, match="dtype float32 asked of a model loaded in bfloat16"):
        build_worker(WorkerSettings(model=str(path), dtype="float32"), loaded=loaded)


def test_a_worker_started_with_no_dtype_runs_a_bf16_checkpoint_as_this_machine_allows(
    tmp_path: Path,
) -> None:
    folder = bf16_checkpoint(tmp_path)
    # bfloat16 on AVX512-BF16 CPUs, float32 (and why) on the others
    expected, why = machine_dtype("auto", "cpu", str(folder))
    worker = launch_worker(["--model", str(folder), "--num-kv-blocks", "16"], timeout_s=120)
    try:
        line = next(x for x in worker.log.splitlines() if "loading model" in x)
    finally:
        worker.stop()
    assert f"on cpu ({expected}; {why})" in line, line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here")
def test_on_a_gpu_auto_runs_a_bf16_checkpoint_in_bf16_and_a_gguf_in_float32(
    tmp_path: Path,
) -> None:
    folder = bf16_checkpoint(tmp_path)
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert machine_dtype("auto", "cuda", str(folder))[0] == ("bfloat16" if native else "float32")
    assert machine_dtype("auto", "cuda", None)[0] == "float32"
    worker = build_worker(WorkerSettings(model=str(folder), device="cuda", num_kv_blocks=16))
    want = "bfloat16" if native else "float32"
    assert worker.runner.kv_layout.endswith("/" + want)
