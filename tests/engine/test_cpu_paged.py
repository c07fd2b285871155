"""The CPU's paged decode kernel (model/cpu_paged.py) against SDPA over each sequence's
gathered context: random block tables in any order, ragged lengths (one token, a block's
edge, past a tile of 32), grouped query heads (1 to 8 a KV head), head sizes its vector
loops take and one they do not, strided queries, one thread and two, and every cache dtype
it reads (float32, bf16, int8 and fp8 rows with their scales), and bf16 queries; each as
this CPU builds the kernel and as a CPU with AVX2 alone does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine_worker.model import cpu_paged
from kvflow.engine_worker.model.kv_quant import QUANTIZED_DTYPES, dequantize, is_quantized, quantize
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, **QUANTIZED_DTYPES}

pytestmark = pytest.mark.skipif(
    not cpu_paged.supports(torch.device("cpu"), torch.float32, torch.float32),
    reason="no C compiler: the engine gathers instead (tests/engine/test_attention.py)",
)

# The kernel as this CPU builds it (with AVX512, its passes for bf16, int8 and fp8 rows), and
# built for AVX2 alone (what a CPU without AVX512 runs; the same build where that is this CPU).
BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which build ``cpu_paged.paged_decode`` calls, for the test."""
    kernel = cpu_paged.build_kernel(BUILDS[request.param])
    assert kernel is not None, "the kernel built natively but not for AVX2"
    monkeypatch.setattr(cpu_paged, "_kernel", lambda: kernel)
    return str(request.param)


def paged_case(
    lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, H, D], a cache of ``dtype`` whose blocks are dealt to the sequences in a random
    order, the padded block tables and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3  # blocks no sequence owns, full of other values
    shape = kv_cache_shape(num_blocks=num_blocks, block_size=block_size,
                           num_kv_heads=num_kv_heads, head_dim=head_dim)  # fmt: skip
    values = torch.randn(shape, generator=gen)
    cache = quantize(values, dtype) if is_quantized(dtype) else values.to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(order[at : at + n])
        at += n
    width = max(counts)
    table = torch.tensor([t + [order[-1]] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    return q, cache, table, torch.tensor(lens)


def reference(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
              scale: float) -> torch.Tensor:  # fmt: skip
    """Each sequence alone: its blocks gathered in order (dequantized), SDPA in float64."""
    if is_quantized(cache.dtype):
        cache = dequantize(cache, torch.float64)
    num_kv_heads, head_dim = cache.shape[3:]
    out = []
    for i, n in enumerate(lens.tolist()):
        kv = cache[table[i]].reshape(-1, 2, num_kv_heads, head_dim)[:n].double()
        keys, values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [Hkv, n, D]
        o = F.scaled_dot_product_attention(
            q[i].double()[:, None], keys, values, scale=scale, enable_gqa=True
        )
        out.append(o[:, 0])
    return torch.stack(out).float()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (32, 8, 128), (4, 4, 64), (64, 8, 128), (6, 2, 80), (4, 2, 36)],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", list(CACHE_DTYPES))
def test_the_kernel_matches_attention_over_the_gathered_context(
    num_heads: int, num_kv_heads: int, head_dim: int, threads: int, cache_dtype: str, build: str
) -> None:
    lens = [1, 15, 16, 17, 31, 32, 33, 200, 7, 513]
    q, cache, table, ctx = paged_case(lens, num_heads, num_kv_heads, head_dim, 16,
                                      seed=head_dim, dtype=CACHE_DTYPES[cache_dtype])  # fmt: skip
    scale = head_dim**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_paged.paged_decode(q, cache, table, ctx, scale)
    finally:
        torch.set_num_threads(before)
    want = reference(q, cache, table, ctx, scale)
    # float32 with float32 accumulation over the values the cache holds: a few ulp of the
    # outputs' size (a quantized row's scale multiplies its dot product, not each value).
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("lens", [[1500], [1500, 3, 700]], ids=["one", "ragged"])
def test_few_long_sequences_are_split_across_threads_and_merged(
    cache_dtype: str, threads: int, lens: list[int], build: str
) -> None:
    """Fewer (sequence, KV head) tasks than two a thread: each context is cut into splits
    (some past a short sequence's end, empty), each attended alone and merged by their maxes
    and sums: the same output as one pass."""
    q, cache, table, ctx = paged_case(lens, 4, 1, 64, 16, seed=4, dtype=CACHE_DTYPES[cache_dtype])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_paged.paged_decode(q, cache, table, ctx, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference(q, cache, table, ctx, 0.125), rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8"])
def test_bf16_queries_attend_in_float32_and_come_back_in_bf16(cache_dtype: str, build: str) -> None:
    """A bf16 model on a CPU with native bf16 hands over bf16 queries (a view of its fused
    QKV output): the kernel widens them, computes in float32 and returns bf16: the float32
    kernel's output on the same (widened) queries, rounded once."""
    lens = [1, 33, 200, 513]
    q, cache, table, ctx = paged_case(lens, 9, 3, 64, 16, seed=5, dtype=CACHE_DTYPES[cache_dtype])
    fused = torch.randn(len(lens), 15, 64).bfloat16()
    fused[:, :9] = q.bfloat16()
    view = fused[:, :9]
    got = cpu_paged.paged_decode(view, cache, table, ctx, 0.125)
    assert got.dtype == torch.bfloat16
    wide = cpu_paged.paged_decode(view.float(), cache, table, ctx, 0.125)
    torch.testing.assert_close(got, wide.bfloat16(), rtol=0, atol=0)
    want = reference(view.float(), cache, table, ctx, 0.125)
    torch.testing.assert_close(wide, want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_strided_queries_and_odd_block_sizes(cache_dtype: str, build: str) -> None:
    """Queries as the model hands them over, a view of the fused QKV output (rows wider than
    the heads), and a block size that is not a power of two."""
    lens = [5, 40, 41, 100]
    q, cache, table, ctx = paged_case(lens, 8, 2, 64, 12, seed=1, dtype=CACHE_DTYPES[cache_dtype])
    fused = torch.randn(len(lens), 12, 64)
    fused[:, :8] = q
    view = fused[:, :8]
    assert not view.is_contiguous()
    got = cpu_paged.paged_decode(view, cache, table, ctx, 0.125)
    torch.testing.assert_close(got, reference(q, cache, table, ctx, 0.125), rtol=0, atol=2e-6)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_a_peaked_softmax_and_scores_far_below_the_max(cache_dtype: str, build: str) -> None:
    """Scores spread over hundreds: the exponentials of most underflow to 0 and the output
    is the one value row the query picks, with no NaN."""
    lens = [64, 300]
    q, cache, table, ctx = paged_case(lens, 4, 1, 64, 16, seed=2, dtype=CACHE_DTYPES[cache_dtype])
    got = cpu_paged.paged_decode(q * 40.0, cache, table, ctx, 1.0)
    want = reference(q * 40.0, cache, table, ctx, 1.0)
    assert torch.isfinite(got).all()
    # Scores of about 40 x 8 = 320 hold float32's ulp of 3e-5: summed in another order (8 or
    # 16 lanes) a score moves by a few of them, its weight e^(s - max) by as much relatively,
    # and an output, a weighing of values up to about 3, by about 1e-4 (measured 4.5e-5).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_what_it_does_not_take_is_refused() -> None:
    q, cache, table, ctx = paged_case([20, 30], 4, 2, 64, 16, seed=3)
    with pytest.raises(ValueError, match="float32 or bfloat16 queries"):
        cpu_paged.paged_decode(q.half(), cache, table, ctx, 0.125)
    with pytest.raises(ValueError, match="float32 or bfloat16 queries"):
        cpu_paged.paged_decode(q, cache.half(), table, ctx, 0.125)
    with pytest.raises(ValueError, match="query heads"):
        cpu_paged.paged_decode(torch.randn(2, 5, 64), cache, table, ctx, 0.125)
    with pytest.raises(ValueError, match="int64"):
        cpu_paged.paged_decode(q, cache, table.int(), ctx, 0.125)
    for cache_dtype in CACHE_DTYPES.values():
        # Attention in float32, and a bf16 model's in bf16 (a CPU with native bf16).
        assert cpu_paged.supports(torch.device("cpu"), cache_dtype, torch.float32)
        assert cpu_paged.supports(torch.device("cpu"), cache_dtype, torch.bfloat16)
    # A float16 cache or compute dtype (the CPU widens float16 models): SDPA's.
    assert not cpu_paged.supports(torch.device("cpu"), torch.float16, torch.float32)
    assert not cpu_paged.supports(torch.device("cpu"), torch.float32, torch.float16)
    assert not cpu_paged.supports(torch.device("meta"), torch.float32, torch.float32)
