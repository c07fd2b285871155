"""FP8 weights (``--quantization fp8``): e4m3 codes with a scale per row, ``_scaled_mm``.

torch's CPU ``_scaled_mm`` runs the same arithmetic as the GPU's, so the module and a
model loaded with it are checked here; the worker refuses FP8 off CUDA (slower than bf16
there), and the CUDA run is a ``gpu`` test in bench/gpu_tests.sh.

Bounds: e4m3 keeps 3 mantissa bits, so a code is within 2**-4 of its value relative to the
row's scale: a product of two quantized operands errs by at most about 2 * 2**-4 of
``|x| @ |W|.T`` per term, and its bf16 output by 2**-8 more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.paged_steps import PagedSteps
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.memory.weight_memory import weight_memory
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.quant.fp8_weight import Fp8Weight, quantize_rows
from kvflow.engine_worker.settings import parse_args


def test_rows_round_trip_within_e4m3s_precision() -> None:
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows of every scale
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = codes.float() * scale
    assert ((back - x).abs() <= 2**-4 * x.abs() + 2**-9 * scale * 448).all()
    zeros, zero_scale = quantize_rows(torch.zeros(2, 16))  # no division by zero
    assert (zeros.float() == 0).all() and (zero_scale > 0).all()


def test_products_stay_within_the_fp8_bound() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=generator)
    x = torch.randn(5, 128, generator=generator).bfloat16()
    fp8 = Fp8Weight(weight)
    assert fp8.nbytes == 96 * 128 + 96 * 4  # a byte a weight and a float32 scale a row
    got = fp8.matmul(x).double()
    want = x.double() @ weight.double().T
    bound = 2 * 2**-4 * (x.double().abs() @ weight.double().abs().T) + 2**-8 * want.abs()
    assert ((got - want).abs() <= bound).all()


def test_a_model_loaded_fp8_holds_its_projections_in_fp8_and_still_answers(
    tmp_path: Path,
) -> None:
    folder = write_tiny_llama(tmp_path / "tiny", vocab_size=512, seed=2, hidden_size=128,
                             intermediate_size=256)  # fmt: skip
    model, config = load_model(folder, dtype=torch.bfloat16, quantization="fp8")
    held = weight_memory(model)
    # Embeddings, norms and the head stay bf16 (RoPE's tables are float32 buffers).
    assert set(held) == {"fp8", "bfloat16", "float32"}
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert linear.weight is None and isinstance(linear.segments[0], Fp8Weight)
    prompt = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    got = PagedSteps(model, config, block_size=16).step({"a": prompt})["a"]
    dense, _ = load_model(folder, dtype=torch.bfloat16)
    want = PagedSteps(dense, config, block_size=16).step({"a": prompt})["a"]
    # e4m3 rounds each operand by up to 2**-4 (about 3.6 % rms), a product by about 5 %,
    # and the 8 quantized products of these two layers compound to about 10 % of the
    # logits' spread (0.094-0.109 over three seeds); 0.15 leaves room, and a wrong scale
    # (per column, or not applied) errs by far more.
    relative_rms = (got - want).pow(2).mean().sqrt() / want.std()
    assert relative_rms < 0.15, relative_rms


def test_fp8_is_refused_off_cuda_with_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "fp8"])
    assert "needs a CUDA GPU with FP8 tensor cores" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_fp8_products_match_the_cpu_ones() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+); not run here")
    weight = torch.randn(512, 256)
    x = torch.randn(33, 256).bfloat16()
    cpu = Fp8Weight(weight).matmul(x).float()
    gpu = Fp8Weight(weight.cuda()).matmul(x.cuda()).float().cpu()
    torch.testing.assert_close(gpu, cpu, rtol=2**-7, atol=2**-7 * float(cpu.abs().max()))
