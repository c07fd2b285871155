"""The paged decode kernel (triton_paged.py) equals the gather-and-SDPA path it replaces.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, read when a
kernel is decorated): the fixture loads a private copy of the module with the variable set,
so the check needs no GPU and leaves any compiled copy alone. Block tables are scattered
permutations of the pool, lengths ragged (1 token, block edges, mid-block), heads grouped
(GQA 3:1 as SmolLM2, 4:1) and not, and the cache float32, bfloat16, int8 or fp8. The
engine has no sliding-window attention (config.py attends to the whole context), so there
is none to test. test_triton_paged_gpu.py runs the compiled kernel through ``paged_attention``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from testkit.paged_kv import BS, CACHE_DTYPES, filled_cache

from kvflow.engine_worker.model import attention
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel

KERNEL_FILE = Path(attention.__file__).with_name("triton_paged.py")


def _triton_modules() -> dict[str, ModuleType]:
    """Triton's Python modules; its compiled extension (triton._C) stays: it cannot be
    loaded twice."""
    return {
        k: m
        for k, m in sys.modules.items()
        if (k == "triton" or k.startswith("triton.")) and not k.startswith("triton._C")
    }


@pytest.fixture(scope="module")
def interpreted() -> Iterator[ModuleType]:
    """triton_paged.py with its kernel decorated under Triton's CPU interpreter.

    Triton reads ``TRITON_INTERPRET`` as it decorates its own library functions (``tl.sum``
    and the like) and again as it launches: while these tests run, a Triton that some
    earlier test imported is set aside and a fresh one, imported with the variable set,
    stands in; afterwards the first is put back."""
    if importlib.util.find_spec("triton") is None:
        # torch's Linux wheels bring Triton, and .ci/run installs them: its absence is a
        # broken environment, not a machine without a GPU.
        pytest.fail("triton is not installed: reinstall torch from PyPI (make setup)")
    before = os.environ.get("TRITON_INTERPRET")
    earlier = _triton_modules()
    for name in earlier:
        del sys.modules[name]
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("triton_paged_interpreted", KERNEL_FILE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        for name in _triton_modules():
            del sys.modules[name]
        sys.modules.update(earlier)


def reference(
    q: torch.Tensor, cache: torch.Tensor, lens: list[int], tables: list[list[int]]
) -> torch.Tensor:
    """The CPU path: gather each group of decodes, padded, and SDPA over it."""
    meta = AttentionMetadata.build(
        query_lens=[1] * len(lens), context_lens=lens, block_tables=tables, block_size=BS
    )
    out = torch.empty_like(q)
    for d in meta.decodes:
        rows = slice(None) if d.rows is None else d.rows
        out[rows] = attention._decode(q[rows], cache, d, q.shape[-1] ** -0.5)
    return out


def padded_table(tables: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int64)


CASES = [
    # heads, kv heads, head dim, context lengths
    pytest.param(9, 3, 64, [1, 4, 5, 13, 22, 9, 17], id="gqa3-d64"),
    pytest.param(8, 2, 32, [3, 16, 30], id="gqa4-d32"),
    pytest.param(4, 4, 24, [7, 1, 12], id="mha-d24"),  # a head dim short of a power of 2
]


@pytest.mark.parametrize("cache_name", list(CACHE_DTYPES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "lens"), CASES)
def test_kernel_equals_the_gather_path(
    interpreted: ModuleType,
    cache_name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lens: list[int],
) -> None:
    cache_dtype = CACHE_DTYPES[cache_name]
    # A quantized cache dequantizes to the model's dtype; float32 here.
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    cache, tables = filled_cache(
        lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        cache_dtype=cache_dtype,
        values_dtype=dtype,
        seed=len(lens) + head_dim,
    )
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    want = reference(q, cache, lens, tables)
    # Padding entries name a block far outside the pool: the kernel must never read them.
    table = padded_table(tables, pad=1 << 40)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for splits in (1, 3):
        got = interpreted.paged_decode(
            q, cache, table, torch.tensor(lens), head_dim**-0.5, splits=splits
        )
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_one_long_context_split_many_ways_is_exact(interpreted: ModuleType) -> None:
    """Batch 1, where the splits fill a GPU: every cut of the context merges to the same
    softmax, including splits whose run lies past the context (they weigh nothing)."""
    lens = [93]
    cache, tables = filled_cache(
        lens,
        num_kv_heads=2,
        head_dim=16,
        cache_dtype=torch.float32,
        values_dtype=torch.float32,
        seed=3,
    )
    q = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(1))
    want = reference(q, cache, lens, tables)
    table = padded_table(tables, pad=0)
    assert interpreted.num_splits(1, 2, table.shape[1]) > 1  # the default splits too
    for splits in (None, 7, 30):  # 30 runs of 1 block: the last lie past the context
        got = interpreted.paged_decode(q, cache, table, torch.tensor(lens), 0.25, splits=splits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_kernel_is_chosen_on_cuda_only() -> None:
    assert not uses_paged_kernel(torch.device("cpu"), 16)
    meta = AttentionMetadata.build(
        query_lens=[1, 1], context_lens=[3, 9], block_tables=[[0], [1, 2, 3]], block_size=BS
    )
    assert all(d.context_lens is None for d in meta.decodes)  # the CPU gathers


def test_split_count_depends_on_shapes_alone(interpreted: ModuleType) -> None:
    kernel = interpreted
    assert kernel.num_splits(64, 8, 4) == 1  # a full GPU and short contexts: no split
    assert kernel.num_splits(1, 8, 1024) == kernel.MAX_SPLITS
    assert kernel.num_splits(1, 8, 8) == 2  # runs of at least MIN_BLOCKS_PER_SPLIT blocks
