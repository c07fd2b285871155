"""Quantized KV rows (model/kv_quant.py): the round trip's error per dtype, the row layout,
what a block costs and how many blocks a budget buys, and the flags that choose it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.model.kv_quant import (
    SCALE_BYTES,
    KvCacheDtypeError,
    dequantize,
    head_dim_of,
    kv_cache_dtype,
    layout_name,
    quantize,
)
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.runner import kv_bytes_per_block
from kvflow.engine_worker.settings import WorkerSettings, parse_args

FP8 = torch.float8_e4m3fn
GIB = 1024**3


def rows(seed: int) -> torch.Tensor:
    """K/V-like rows [tokens, 2, heads, 64]: unit normal with a few outlier channels (x20,
    as real keys have) and rows of very different magnitudes, zeros and tiny ones included."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 2, 3, 64, generator=gen)
    x[..., 5] *= 20
    x *= torch.logspace(-6, 3, 64)[:, None, None, None]  # a row's amax from 1e-5 to 1e4
    x[0] = 0.0
    return x


def test_int8_round_trip_is_within_half_a_step_of_each_rows_scale() -> None:
    x = rows(0)
    stored = quantize(x, torch.int8)
    assert stored.shape == (64, 2, 3, 64 + SCALE_BYTES) and stored.dtype == torch.int8
    back = dequantize(stored, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    scale = stored.view(torch.uint8)[..., 64:].view(torch.float16).float()
    # The stored scale is amax / 127 in float16 (clamped to its smallest normal, 2^-14).
    want = (amax / 127).clamp(min=2.0**-14)
    assert torch.allclose(scale, want.half().float(), rtol=0, atol=0)
    # Values are rounded to the nearest step of the stored scale: half a step at most.
    assert ((back - x).abs() <= scale / 2 + 1e-12).all()
    assert stored[..., :64].abs().max() == 127  # the full range is used
    assert back[0].eq(0).all()  # an all-zero row stays zero, no NaN


def test_fp8_round_trip_is_within_e4m3s_rounding() -> None:
    x = rows(1)
    stored = quantize(x, FP8)
    back = dequantize(stored, torch.float32)
    scale = stored.view(torch.uint8)[..., 64:].view(torch.float16).float()
    # e4m3 keeps 3 mantissa bits: a normal value (|x / scale| >= 2^-6) is off by at most
    # 2^-4 of itself, a subnormal one by at most half its spacing 2^-9.
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert back.isfinite().all() and back[0].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
def test_a_cache_of_quantized_rows_keeps_its_head_dim_and_names_its_dtype(
    dtype: torch.dtype,
) -> None:
    cache = torch.zeros(4, 16, 2, 3, 64 + SCALE_BYTES, dtype=dtype)
    assert head_dim_of(cache) == 64
    assert head_dim_of(torch.zeros(4, 16, 2, 3, 64)) == 64
    name = "int8" if dtype == torch.int8 else "float8_e4m3fn"
    assert layout_name(dtype) == f"{name}+float16scales"
    assert layout_name(torch.bfloat16) == "bfloat16"  # auto: named as before


def test_names_map_to_dtypes_and_a_bad_name_says_what_to_choose() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_cache_dtype("fp8", torch.float32) == FP8
    with pytest.raises(KvCacheDtypeError, match=r"auto.*int8.*fp8"):
        kv_cache_dtype("int4", torch.float32)


# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64, blocks of 16 tokens.
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16}


def test_bytes_per_block_count_the_scales() -> None:
    f32 = kv_bytes_per_block(**SMOLLM2, dtype=torch.float32)
    bf16 = kv_bytes_per_block(**SMOLLM2, dtype=torch.bfloat16)
    int8 = kv_bytes_per_block(**SMOLLM2, dtype=torch.int8)
    fp8 = kv_bytes_per_block(**SMOLLM2, dtype=FP8)
    assert (f32, bf16) == (737_280, 368_640)
    assert int8 == fp8 == 2 * 30 * 16 * 3 * (64 + 2)  # 190,080: a 2-byte scale per row
    # Per byte: 3.88x the tokens of a float32 cache. Against bf16 1.94x, not 2x: any scale
    # stored per token costs 2 x 64 / (64 + s) < 2 for s > 0 (1.97x at head_dim 128).
    assert f32 / int8 == pytest.approx(3.879, abs=1e-3)
    assert bf16 / int8 == pytest.approx(1.939, abs=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = write_tiny_llama(tmp_path_factory.mktemp("kvq") / "model", seed=3)
    return path, load_model(str(path))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_a_budget_of_quantized_cache_holds_more_tokens(tiny: tuple[Path, object], kv: str) -> None:
    """The tiny model (2 layers, 2 KV heads of 16) in float32: 2 x 2 x 16 x 2 x 16 x 4 B =
    8 KiB a block; quantized, 16 values + a 2-byte scale per row: 2,304 B, 3.56x the tokens
    (a head of 16 pays the scale 4x as dearly as SmolLM2's of 64)."""
    path, loaded = tiny

    def worker(kv_dtype: str) -> tuple[int, int]:
        settings = WorkerSettings(model=str(path), kv_cache_gib=0.01, kv_cache_dtype=kv_dtype)
        built = build_worker(settings, loaded=loaded)  # type: ignore[arg-type]
        return built.info.num_total_blocks, built.memory.kv_cache_bytes

    auto_blocks, auto_bytes = worker("auto")
    blocks, num_bytes = worker(kv)
    assert auto_blocks == int(0.01 * GIB) // 8192
    assert blocks == int(0.01 * GIB) // 2304
    assert blocks / auto_blocks == pytest.approx(8192 / 2304, abs=0.01)
    assert num_bytes <= 0.01 * GIB and auto_bytes <= 0.01 * GIB


def test_flags_refuse_what_cannot_work_and_say_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_args([]).kv_cache_dtype == "auto"
    assert parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"  # the CPU has it
    for argv, says in (
        (["--kv-cache-dtype", "int4"], "invalid choice"),
        (["--simulate", "--kv-cache-dtype", "int8"], "drop --kv-cache-dtype"),
        (["--kv-cache-dtype", "fp8", "--device", "nonsense"], "use --kv-cache-dtype int8"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert says in capsys.readouterr().err, argv
