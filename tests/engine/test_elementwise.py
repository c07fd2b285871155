"""The C passes for a decode step's norms and RoPE (model/elementwise.c) agree with float64
as closely as torch's ops do (in bf16: round where torch's ops round, so agree with them
bit for bit but for a rare last-bit tie of the norm's scale), the model's layers use them,
and where they do not apply (strided rows, many rows, mixed dtypes, no compiler) the
layers run torch's ops instead."""

from __future__ import annotations

import pytest
import torch

from kvflow.engine_worker.model import elementwise
from kvflow.engine_worker.model.llama import RMSNorm
from kvflow.engine_worker.model.rope import Rotation


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's layers as where no compiler runs: torch's ops alone."""
    monkeypatch.setattr(elementwise, "_library", lambda: None)


def test_the_kernels_build_here() -> None:
    assert elementwise.available(), "this machine has a C compiler (cc): the kernels must build"


def _norm(n: int, seed: int) -> RMSNorm:
    torch.manual_seed(seed)
    norm = RMSNorm(n, 1e-5, torch.float32, torch.device("cpu"))
    norm.weight.data.normal_()
    return norm


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n", [576, 1000, 37])  # 1000, 37: tails past the 16 lanes
def test_rms_norm_is_as_close_to_float64_as_torchs_ops(
    rows: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    norm = _norm(n, rows * 1000 + n)
    wide = torch.randn(rows, n + 24) * 3
    x = wide[:, :n]  # rows further apart than their width, as a slice of a wider output
    native = norm.forward(x)
    assert torch.equal(native, elementwise.rms_norm(x, norm.weight, norm.eps))  # the kernel's
    _torch_only(monkeypatch)
    by_torch = norm.forward(x)
    x64 = x.double()
    exact = x64 / (x64.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight.double()
    native_error = (native.double() - exact).abs().max().item()
    torch_error = (by_torch.double() - exact).abs().max().item()
    # Both round the same products; the sums differ in order (float lanes, then double).
    assert native_error <= 2 * torch_error + 1e-7, (native_error, torch_error)
    assert torch.allclose(native, by_torch, rtol=2e-6, atol=2e-6)


def _qkv(rows: int, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """A fused QKV output: Q and K's heads first, then V's."""
    return torch.randn(rows, (heads + 2 * kv_heads) * head_dim)


def _rotation(rows: int, head_dim: int) -> Rotation:
    angles = torch.rand(rows, 1, head_dim // 2) * 6.3
    angles = torch.cat([angles, angles], dim=-1)
    sign = torch.cat([-torch.ones(head_dim // 2), torch.ones(head_dim // 2)])
    return Rotation(angles.cos(), angles.sin() * sign)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rope_rotates_q_and_k_in_place_as_torchs_ops_and_leaves_v(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2's GQA shape
    qkv = _qkv(rows, heads, kv_heads, head_dim)
    rotation = _rotation(rows, head_dim)
    qk_size = (heads + kv_heads) * head_dim
    native, by_torch = qkv.clone(), qkv.clone()
    out = rotation.apply_(native[:, :qk_size].view(rows, heads + kv_heads, head_dim))
    assert out.data_ptr() == native.data_ptr()
    _torch_only(monkeypatch)
    rotation.apply_(by_torch[:, :qk_size].view(rows, heads + kv_heads, head_dim))
    assert not torch.equal(native, qkv)  # rotated
    assert torch.equal(native[:, qk_size:], qkv[:, qk_size:])  # V untouched
    assert torch.allclose(native, by_torch, rtol=1e-6, atol=1e-6)
    # A rotation keeps each pair's length.
    pairs = native[:, :qk_size].view(rows, heads + kv_heads, 2, head_dim // 2)
    before = qkv[:, :qk_size].view(rows, heads + kv_heads, 2, head_dim // 2)
    assert torch.allclose(pairs.norm(dim=2), before.norm(dim=2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n", [576, 1000, 37])
def test_bf16_rms_norm_rounds_where_torchs_ops_round(
    rows: int, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference's bf16 norm: the normed row rounded to bf16, then times the bf16
    weight, rounded. Only the scale's float32 sum differs in order (lanes, then double,
    against torch's reduction), so an output may differ by its last bit where the product
    falls within an ulp of a tie; over these rows none or nearly none do."""
    torch.manual_seed(rows * 1000 + n)
    norm = RMSNorm(n, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data.normal_()
    x = (torch.randn(rows, n + 24) * 3).bfloat16()[:, :n]
    native = norm.forward(x)
    assert native.dtype is torch.bfloat16
    assert torch.equal(native, elementwise.rms_norm(x, norm.weight, norm.eps))  # the kernel's
    _torch_only(monkeypatch)
    by_torch = norm.forward(x)
    differ = native != by_torch
    assert differ.float().mean().item() <= 0.002, f"{int(differ.sum())} of {x.numel()} differ"
    # where they differ, by one bf16 ulp at most (2^-7 of the value)
    gap = (native.float() - by_torch.float()).abs()
    assert (gap <= by_torch.float().abs() * 2.0**-7 + 1e-30).all()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_rope_equals_torchs_ops_bit_for_bit(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = _qkv(rows, heads, kv_heads, head_dim).bfloat16()
    rotation = _rotation(rows, head_dim)
    rotation = Rotation(rotation.cos.bfloat16(), rotation.sin.bfloat16())
    qk_size = (heads + kv_heads) * head_dim
    native, by_torch = qkv.clone(), qkv.clone()
    view = native[:, :qk_size].view(rows, heads + kv_heads, head_dim)
    assert elementwise.rope_(view, rotation.cos, rotation.sin) is view  # the kernel's
    _torch_only(monkeypatch)
    rotation.apply_(by_torch[:, :qk_size].view(rows, heads + kv_heads, head_dim))
    assert not torch.equal(native, qkv)
    assert torch.equal(native, by_torch)


def test_the_kernels_decline_what_they_do_not_read() -> None:
    weight = torch.ones(576)
    bf16 = torch.randn(2, 576, dtype=torch.bfloat16)
    assert elementwise.rms_norm(bf16, weight, 1e-5) is None  # a float32 weight: mixed
    assert elementwise.rms_norm(torch.randn(2, 576 * 2)[:, ::2], weight, 1e-5) is None
    many = elementwise.MAX_NATIVE_ELEMENTS // 576 + 1
    assert elementwise.rms_norm(torch.randn(many, 576), weight, 1e-5) is None
    rotation = _rotation(2, 64)
    x = torch.randn(2, 4, 64)
    untouched = x.clone()
    assert elementwise.rope_(x.transpose(0, 1), rotation.cos, rotation.sin) is None
    assert elementwise.rope_(x.bfloat16(), rotation.cos, rotation.sin) is None  # mixed
    assert torch.equal(x, untouched)


def test_many_rows_and_bf16_still_normalise_through_torchs_ops() -> None:
    many = elementwise.MAX_NATIVE_ELEMENTS // 576 + 1
    norm = _norm(576, 1)
    x = torch.randn(many, 576)
    out = norm.forward(x)
    exact = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert torch.allclose(out.double(), exact * norm.weight.double(), rtol=1e-5, atol=1e-5)
    bf16 = RMSNorm(576, 1e-5, torch.bfloat16, torch.device("cpu"))
    bf16.weight.data.copy_(norm.weight)
    assert bf16.forward(x[:2].bfloat16()).dtype == torch.bfloat16
