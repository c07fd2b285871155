"""4-bit planes in torch's CPU int4 layout: read back exactly, multiplied within bf16's error.

The reference for every product is float64 over the planes' own weights, with the scales
and zeros rounded to bf16 as the kernels hold them. ``Int4Weight`` computes in bf16 (the
kernel's activations and output; the widened path's GEMM), so an output may err by a few
bf16 roundings of its terms: the bound used is ``2**-7`` of ``|x| @ |W|.T`` (every term's
rounding, 2**-9 each for x, the weight and the accumulation, with room) plus ``2**-8`` of
the output itself (its own rounding to bf16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from kvflow.engine_worker.model import native_build
from kvflow.engine_worker.model.quant import int4_weight, native
from kvflow.engine_worker.model.quant.cpu_layout import cpu_layout, pack
from kvflow.engine_worker.model.quant.int4_weight import Int4Weight
from kvflow.engine_worker.model.quant.planes import Int4Planes


def planes(rows: int, cols: int, num_planes: int, group: int = 32, seed: int = 0) -> Int4Planes:
    rng = np.random.default_rng(seed)
    width = num_planes * cols
    return Int4Planes(
        codes=rng.integers(0, 16, (rows, width), dtype=np.uint8),
        scales=rng.uniform(0.001, 0.02, (rows, width // group)).astype(np.float32),
        zeros=rng.uniform(-0.1, 0.1, (rows, width // group)).astype(np.float32),
        group_size=group,
        num_planes=num_planes,
    )


def exact_weights(p: Int4Planes) -> torch.Tensor:
    """W in float64 from the planes with bf16 scales and zeros (what the kernels hold)."""
    rounded = Int4Planes(
        p.codes,
        torch.from_numpy(p.scales).bfloat16().double().numpy(),
        torch.from_numpy(p.zeros).bfloat16().double().numpy(),
        p.group_size,
        p.num_planes,
    )
    return torch.from_numpy(rounded.dequantize().astype(np.float64))


def assert_product(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    want = x.double() @ weights.T
    bound = 2**-7 * (x.double().abs() @ weights.abs().T) + 2**-8 * want.abs()
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"error above the bf16 bound by {excess.max():.3g}"


_USE_NATIVE_GEMV = int4_weight.use_native_gemv  # the cached choice, under any monkeypatch


def _clear_kernel_caches() -> None:
    native.native_widener.cache_clear()
    native.native_gemv.cache_clear()
    _USE_NATIVE_GEMV.cache_clear()
    int4_weight._widen_min_rows.cache_clear()


@pytest.fixture(params=["gemv", "gemv-avx2", "gemv-int8", "native", "torch"])
def widener(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every set of CPU kernels: kvflow's GEMV for few rows and its widening for many (scales
    block-major; the engine's choice on a CPU with AVX2), as this CPU builds it and as an
    AVX2-only CPU does (``-mno-avx512f``: the same code where the CPU has no AVX512), on
    float32 activations and on int8 ones (asked for); torch's int4 kernel with kvflow's
    widening (scales as torch keeps them); and torch's kernel and ops alone (no compiler)."""
    _clear_kernel_caches()
    if request.param == "torch":
        monkeypatch.setenv(native_build.NATIVE_ENV, "0")
    else:
        assert native.native_widener() is not None, "this machine has a C compiler: cc"
        assert native.native_gemv() is not None, "this machine has a C compiler: cc"
        gemv = request.param.startswith("gemv")
        monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: gemv)
        if request.param == "gemv-avx2":
            avx2_only = native.native_gemv(("-mno-avx512f",))
            assert avx2_only is not None
            monkeypatch.setattr(int4_weight, "native_gemv", lambda: avx2_only)
        int8 = request.param == "gemv-int8"
        monkeypatch.setattr(int4_weight, "gemv_activations", lambda: "int8" if int8 else "float32")
    yield request.param
    _clear_kernel_caches()


@pytest.mark.parametrize("rows", [64, 208, 1008, 1024 + 64 + 48])  # N % 16 == 0: the op's rule
def test_the_layout_reads_every_code_back(rows: int) -> None:
    codes = torch.randint(0, 16, (rows, 96), dtype=torch.uint8)
    packed = pack(codes)
    layout = cpu_layout()
    np.testing.assert_array_equal(
        layout.read_rows(packed, torch.arange(rows), rows, 96).numpy(), codes.numpy()
    )
    picked = torch.tensor([rows - 1, 0, rows // 2, 17])
    assert torch.equal(layout.read_rows(packed, picked, rows, 96), codes[picked])
    full = rows // layout.block_n
    assert torch.equal(layout.read_full_blocks(packed, 96, full), codes[: full * layout.block_n].T)


@pytest.mark.parametrize(
    ("rows", "cols", "num_planes", "group"),
    [(192, 256, 1, 32), (200, 256, 2, 32), (1100, 512, 4, 256), (64, 64, 1, 64)],
)
@pytest.mark.parametrize("batch", [1, 3, 16, 200])
def test_products_at_every_batch_size_stay_within_bf16(
    widener: str, rows: int, cols: int, num_planes: int, group: int, batch: int
) -> None:
    p = planes(rows, cols, num_planes, group)
    weight = Int4Weight(p)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    got = weight.matmul(x)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    assert_product(got, x, exact_weights(p))


def test_large_batches_widen_and_small_ones_use_the_kernel(
    widener: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counting(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def count(*args: object) -> torch.Tensor:
            calls.append(1)
            return kernel(*args)

        return count

    if widener.startswith("gemv"):
        gemv = int4_weight.native_gemv()
        assert gemv is not None
        monkeypatch.setattr(int4_weight, "native_gemv", lambda: counting(gemv))
    else:
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", counting(kernel))
    weight = Int4Weight(planes(128, 64, 1))
    threshold = weight.widen_min_rows()
    if widener == "gemv-int8":
        # a float32 GEMM must beat 32 codes an instruction; over AVX512's blocks of 64 rows
        # the rounded x takes the float32 loop, and widening comes as early as for it
        int8_loop = int4_weight.cpu_layout().block_n == 32
        expected = (
            int4_weight.WIDEN_MIN_ROWS_INT8_GEMV if int8_loop else int4_weight._widen_min_rows()
        )
        assert threshold == expected
    weight.matmul(torch.randn(threshold - 1, 64))
    assert calls == [1]
    weight.matmul(torch.randn(threshold, 64))
    assert calls == [1], "a batch at the threshold is widened, not sent to the kernel"


@pytest.mark.parametrize(
    ("rows", "cols", "num_planes", "group"),
    [(192, 256, 1, 32), (200, 256, 2, 32), (1100, 512, 4, 256), (80, 64, 1, 64)],
)
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 6, 8, 11, 13])
def test_the_native_gemv_is_exact_in_float32(
    monkeypatch: pytest.MonkeyPatch, rows: int, cols: int, num_planes: int, group: int, batch: int
) -> None:
    """Float32 activations and sums, so within float32's error of the exact product: full
    blocks and a partial last one (200 and 80 rows: 16 past a block), several planes, rows
    of x six, four, two at a time and alone (11: 6 + 4 + 1), and more rows than one call
    takes (13)."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    monkeypatch.setattr(int4_weight, "gemv_activations", lambda: "float32")
    p = planes(rows, cols, num_planes, group)
    weight = Int4Weight(p)
    assert weight.native and not weight.int8_activations
    assert native.native_gemv() is not None, "this machine has a C compiler: cc"
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    got = weight._matmul_native(x)
    exact = exact_weights(p)
    want = x.double() @ exact.T
    bound = 2**-20 * (x.double().abs() @ exact.abs().T)
    assert got.shape == (batch, rows) and got.dtype == torch.float32
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"error above float32's bound by {excess.max():.3g}"


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the GEMV rounds it: blocks of 32 columns, d = amax / 127 and q = x / d
    rounded half away from zero, in float32 as ``gemv_int4.c`` computes them; -> d * q."""
    blocks = x.view(x.shape[0], -1, native.GEMV_INT8_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.trunc(blocks * inverse + torch.where(blocks < 0, -0.5, 0.5)).clamp(-127, 127)
    return (d * q).view_as(x)


def zero_weights(p: Int4Planes) -> torch.Tensor:
    """The zeros' part of W, float64: each group's z (planes summed), as code 8 gives it."""
    return exact_weights(Int4Planes(np.full_like(p.codes, 8), p.scales, p.zeros, p.group_size,
                                    p.num_planes))  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "cols", "num_planes", "group"),
    [(192, 256, 1, 32), (200, 256, 2, 32), (1100, 512, 4, 256), (80, 64, 1, 64)],
)
@pytest.mark.parametrize("batch", [1, 2, 3, 9])
def test_the_native_gemv_with_int8_activations_is_w_times_the_rounded_x(
    monkeypatch: pytest.MonkeyPatch, rows: int, cols: int, num_planes: int, group: int, batch: int
) -> None:
    """``KVFLOW_GEMV_ACTIVATIONS=int8`` (AVX2 CPUs): x rounded to int8 per 32 columns, times
    the exact W, within float32's error of its two terms (the centred codes' integer sums
    and the zeros); in full blocks (integer dot products) and partial ones (float32 on the
    rounded x). So it errs from the exact product by at most half a rounding step a weight."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    monkeypatch.setattr(int4_weight, "gemv_activations", lambda: "int8")
    p = planes(rows, cols, num_planes, group)
    weight = Int4Weight(p)
    assert weight.int8_activations
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    got = weight._matmul_native(x).double()
    rounded = int8_rows(x).double()
    exact, zeros = exact_weights(p), zero_weights(p)
    terms = (exact - zeros).abs() + zeros.abs()  # s (c - 8) and z, summed apart
    bound = 2**-20 * (rounded.abs() @ terms.T)
    assert got.shape == (batch, rows)
    excess = (got - rounded @ exact.T).abs() - bound
    assert excess.max() <= 0, f"error above float32's bound by {excess.max():.3g}"
    step = x.view(batch, -1, native.GEMV_INT8_BLOCK).abs().amax(-1) / 127  # [batch, blocks]
    half_steps = step.repeat_interleave(native.GEMV_INT8_BLOCK, dim=1).double() / 2
    assert ((got - x.double() @ exact.T).abs() <= half_steps @ exact.abs().T + bound).all()


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_stays_non_finite_in_its_row_alone(
    monkeypatch: pytest.MonkeyPatch, activations: str, bad: float
) -> None:
    """Rounding to int8 must not turn a NaN or inf into a finite number (a broken step
    would then look like a real one); the other rows of x are untouched."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    monkeypatch.setattr(int4_weight, "gemv_activations", lambda: activations)
    weight = Int4Weight(planes(200, 256, 1))
    x = torch.randn(3, 256)
    x[1, 70] = bad
    got = weight._matmul_native(x)
    assert not got[1].isfinite().any()
    assert got[0].isfinite().all() and got[2].isfinite().all()


def test_the_gemv_refuses_what_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its C reads raw pointers: x is checked on every call, W's tensors once, when the
    weight is built; wrong ones get a ValueError, not a read past their memory."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    weight = Int4Weight(planes(64, 64, 1))
    gemv = native.native_gemv()
    assert gemv is not None
    layout = cpu_layout()
    args = (64, 64, 1, 32, layout.block_n, int(layout.interleaved), True)
    for bad in (torch.randn(2, 64).double(), torch.randn(2, 96), torch.randn(64, 2).T):
        with pytest.raises(ValueError, match="gemv takes float32 rows of 64"):
            gemv(weight.packed, weight.scales_zeros, bad, *args)
    torch_layout = weight.rows_scales_zeros(0, 64).contiguous()  # [groups, rows, 2]
    with pytest.raises(ValueError, match="block-major"):
        native.check_gemv_weight(weight.packed, torch_layout, 64, 1, 32, layout.block_n)
    with pytest.raises(ValueError, match="dense uint8"):
        native.check_gemv_weight(weight.packed.T, weight.scales_zeros, 64, 1, 32, layout.block_n)


def test_gemv_activations_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    int4_weight.gemv_activations.cache_clear()
    try:
        monkeypatch.delenv(int4_weight.GEMV_ACTIVATIONS_ENV, raising=False)
        assert int4_weight.gemv_activations() == "float32"
        int4_weight.gemv_activations.cache_clear()
        monkeypatch.setenv(int4_weight.GEMV_ACTIVATIONS_ENV, "int8")
        assert int4_weight.gemv_activations() == "int8"
        int4_weight.gemv_activations.cache_clear()
        monkeypatch.setenv(int4_weight.GEMV_ACTIVATIONS_ENV, "fp16")
        with pytest.raises(ValueError, match="use int8 or float32"):
            int4_weight.gemv_activations()
        # Refused by a weight built where the GEMV is not used (an AVX512 CPU) as well.
        monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: False)
        with pytest.raises(ValueError, match="use int8 or float32"):
            Int4Weight(planes(64, 64, 1))
    finally:
        int4_weight.gemv_activations.cache_clear()


def test_the_native_gemv_gives_the_same_sums_on_any_number_of_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block of rows is one thread's, whole: the threads split work, not sums. And the
    kernel shares torch's OpenMP runtime, not a second one beside it."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    weight = Int4Weight(planes(1024 + 48, 512, 1))
    assert weight.native
    x = torch.randn(3, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight.matmul(x)
        torch.set_num_threads(2)
        two = weight.matmul(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert native_build.one_openmp_runtime()


@pytest.mark.parametrize("batch", [1, 2, 4, 6])
def test_the_gemvs_prefetches_change_no_result(monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """The loops prefetch the groups ahead (prefetch_group): a hint, never a read the sums
    see. A build without them gives the same floats, bit for bit, at every row path."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: True)
    weight = Int4Weight(planes(256 + 32, 512, 2, group=64))
    assert weight.native
    x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(batch))
    prefetching = weight.matmul(x)
    without = native.native_gemv(("-DGEMV_PF_GROUPS=0",))
    assert without is not None, "this machine has a C compiler: cc"
    monkeypatch.setattr(int4_weight, "native_gemv", lambda: without)
    assert torch.equal(weight.matmul(x), prefetching)


@pytest.mark.parametrize("block_major", [True, False])
def test_the_native_widener_is_exact_in_float32(
    monkeypatch: pytest.MonkeyPatch, block_major: bool
) -> None:
    """From either layout of the scales: the GEMV's block-major one and torch's."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: block_major)
    widen = native.native_widener()
    assert widen is not None
    p = planes(256 + 64, 128, 2)
    weight = Int4Weight(p)
    assert weight.native == block_major
    layout = cpu_layout()
    out = torch.empty(128, 256, dtype=torch.float32)  # two blocks of 64... and more
    widen(
        weight.packed, weight.scales_zeros, weight._scale_strides(), out, 128, 2, 32,
        layout.block_n, int(layout.interleaved), 0, 256,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), exact_weights(p)[:256].T, rtol=1e-6, atol=1e-7)


def test_rows_and_the_whole_matrix_come_back_in_float32() -> None:
    p = planes(200, 96, 2)
    weight = Int4Weight(p)
    exact = exact_weights(p)
    ids = torch.tensor([199, 0, 64, 65, 130])
    torch.testing.assert_close(weight.take_rows(ids).double(), exact[ids], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weight.dequantize().double(), exact, rtol=1e-6, atol=1e-7)
    assert weight.nbytes == weight.packed.nbytes + weight.scales_zeros.nbytes
    # 4 bits a code, 2 planes, plus a bf16 scale and zero per 32 codes; rows padded to 208
    # (the scales of the native kernels' layout to whole blocks of rows).
    scale_rows = -(-208 // cpu_layout().block_n) * cpu_layout().block_n if weight.native else 208
    assert weight.nbytes == 208 * 2 * 96 // 2 + scale_rows * 2 * 96 // 32 * 4


@pytest.mark.gpu
def test_cuda_products_match_the_cpu_ones() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; not run here")
    p = planes(512, 256, 2)
    cpu, gpu = Int4Weight(p), Int4Weight(p, "cuda")
    gpu.keep_rows(p)
    x = torch.randn(7, 256)
    assert_product(gpu.matmul(x.cuda()).cpu(), x, exact_weights(p))
    ids = torch.tensor([3, 500])
    torch.testing.assert_close(gpu.take_rows(ids.cuda()).cpu(), cpu.take_rows(ids))
