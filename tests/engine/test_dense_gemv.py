"""kvflow's bf16 GEMV (model/gemv_bf16.c) at a decode step's few rows: as close to the
exact product as a float32 sum rounded once to bf16 can be, with bias and residual, over
ragged shapes and strided rows, on one thread and two; the model's products use it; and
where it does not apply (float32, many rows, a layout it does not read, no AVX512-BF16) the
caller runs torch's linear instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine_worker.auto_dtype import CPU_BF16_FLAGS, cpu_flags
from kvflow.engine_worker.model import dense_gemv
from kvflow.engine_worker.model.linear import Linear, head_logits

HAS_BF16 = bool(CPU_BF16_FLAGS & cpu_flags(Path("/proc/cpuinfo").read_text()))
needs_bf16 = pytest.mark.skipif(
    not HAS_BF16, reason="the kernel needs AVX512-BF16, which this CPU lacks"
)


def test_the_kernel_builds_where_the_cpu_has_bf16() -> None:
    assert dense_gemv.available() == HAS_BF16


def _exact(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 over the same bf16 inputs, and the sum of its terms' sizes
    (what a float32 sum's rounding scales with)."""
    exact = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact, size = exact + bias.double(), size + bias.double().abs()
    if residual is not None:
        exact, size = exact + residual.double(), size + residual.double().abs()
    return exact, size


def _assert_rounded_sum(
    out: torch.Tensor, exact: torch.Tensor, size: torch.Tensor, cols: int
) -> None:
    """Within half a bf16 ulp of the exact value (2^-9 of it relative, bounded by 2^-8 for
    the ulp's binade) plus a float32 sum's worst error over ``cols`` terms."""
    assert out.dtype is torch.bfloat16
    error = (out.double() - exact).abs()
    bound = exact.abs() * 2.0**-8 + size * cols * 2.0**-24 + 1e-30
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("out_features", "cols"),
    [(576, 576), (7, 1000), (130, 37), (3072, 576), (96, 1536)],  # tails: rows % 4, cols % 32
)
def test_the_product_is_the_exact_sum_rounded_once(
    threads: int, rows: int, out_features: int, cols: int
) -> None:
    torch.manual_seed(rows * 7919 + out_features * 31 + cols)
    w = (torch.randn(out_features, cols) * 0.05).bfloat16()
    wide = torch.randn(rows, cols + 40).bfloat16()
    x = wide[:, 5 : 5 + cols]  # rows further apart than their width, a view into a wider row
    bias = torch.randn(out_features).bfloat16()
    residual_wide = torch.randn(rows, out_features + 8).bfloat16()
    residual = residual_wide[:, :out_features]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, r in ((None, None), (bias, None), (None, residual), (bias, residual)):
            out = dense_gemv.linear(x, w, b, r)
            assert out is not None and out.shape == (rows, out_features)
            _assert_rounded_sum(out, *_exact(x, w, b, r), cols)
    finally:
        torch.set_num_threads(before)


@needs_bf16
def test_it_is_no_further_from_exact_than_torchs_linear() -> None:
    """Over many products the kernel's error matches torch's (both sum in float32 and round
    once): a kernel that lost precision would sit well above."""
    torch.manual_seed(0)
    w = (torch.randn(2048, 576) * 0.05).bfloat16()
    x = torch.randn(3, 576).bfloat16()
    exact, _ = _exact(x, w, None, None)
    ours = dense_gemv.linear(x, w)
    assert ours is not None
    ours_error = (ours.double() - exact).abs().mean().item()
    torch_error = (F.linear(x, w).double() - exact).abs().mean().item()
    assert ours_error <= 1.05 * torch_error, (ours_error, torch_error)
    same = (ours == F.linear(x, w)).float().mean().item()
    assert same > 0.95, f"only {same:.3f} of outputs equal torch's"


@needs_bf16
def test_the_prefetches_change_no_result() -> None:
    torch.manual_seed(1)
    w = (torch.randn(1000, 700) * 0.05).bfloat16()
    x = torch.randn(4, 700).bfloat16()
    with_prefetch = dense_gemv.linear(x, w)
    without = dense_gemv.linear(x, w, extra_flags=("-DPF_ROWS=0",))
    assert with_prefetch is not None and without is not None
    assert torch.equal(with_prefetch, without)


@needs_bf16
def test_nan_and_inf_pass_through() -> None:
    w = torch.ones(8, 64).bfloat16()
    x = torch.ones(1, 64).bfloat16()
    x[0, 3] = float("nan")
    out = dense_gemv.linear(x, w)
    assert out is not None and out.isnan().all()
    x[0, 3] = float("inf")
    out = dense_gemv.linear(x, w)
    assert out is not None and out.isinf().all() and (out > 0).all()


def test_what_is_not_the_kernels_returns_none() -> None:
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(1, 32).bfloat16()
    assert dense_gemv.linear(x.float(), w.float()) is None  # float32: torch's
    assert dense_gemv.linear(torch.randn(5, 32).bfloat16(), w) is None  # past MAX_ROWS
    assert dense_gemv.linear(x, torch.randn(32, 64).bfloat16().t()) is None  # columns strided
    assert dense_gemv.linear(x[:, ::2], w[:, :16]) is None  # strided columns of x
    assert dense_gemv.linear(x, w, residual=torch.randn(1, 64)) is None  # float32 residual
    assert dense_gemv.linear(x.unsqueeze(0), w) is None  # not 2-D


def test_without_native_kernels_torch_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_NATIVE_KERNELS", "0")
    dense_gemv._kernel.cache_clear()
    try:
        assert (
            dense_gemv.linear(torch.randn(1, 32).bfloat16(), torch.randn(8, 32).bfloat16()) is None
        )
    finally:
        dense_gemv._kernel.cache_clear()


def _linear(out_features: int, cols: int) -> Linear:
    torch.manual_seed(out_features + cols)
    lin = Linear(cols, out_features, bias=True, dtype=torch.bfloat16, device=torch.device("cpu"))
    lin.weight.data.normal_(std=0.05)  # type: ignore[union-attr]
    assert lin.bias is not None
    lin.bias.data.normal_()
    return lin


@needs_bf16
def test_the_models_products_take_it_at_few_rows_and_torch_past_them() -> None:
    lin = _linear(200, 576)
    weight, bias = lin.weight, lin.bias
    assert weight is not None and bias is not None
    with torch.inference_mode():
        for rows in (1, 4):
            x = torch.randn(rows, 576).bfloat16()
            residual = torch.randn(rows, 200).bfloat16()
            assert torch.equal(lin.forward(x), dense_gemv.linear(x, weight, bias))
            assert torch.equal(
                lin.add_to(residual, x), dense_gemv.linear(x, weight, bias, residual)
            )
        x = torch.randn(8, 576).bfloat16()
        assert torch.equal(lin.forward(x), F.linear(x, weight, bias))
        head = _linear(300, 576)
        head.bias = None
        hidden = torch.randn(2, 576).bfloat16()
        logits = head_logits(hidden, head)
        assert head.weight is not None
        kernel = dense_gemv.linear(hidden, head.weight)
        assert kernel is not None and torch.equal(logits, kernel.float())
