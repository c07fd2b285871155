"""Decode attention on the CPU that reads K/V in place from the paged cache (``cpu_paged.c``):
the CPU's sibling of triton_paged.py, with the same call.

Without it a decode step's attention on the CPU is a gather of every sequence's blocks (or
the decode workspace's dense copies of them) and SDPA over a batch padded to its longest
context: one query token per sequence makes each SDPA call a few tiny products per head, so
its fixed cost and the padding are most of the time. The kernel walks each sequence's block
table and reads its own tokens once, the query heads of a KV head together (GQA), in one
call per layer for the whole batch, threaded over (sequence, KV head) on torch's OpenMP pool.

It computes in float32, over a cache of float32, bf16, or int8 or fp8 rows with their
scales (kv_quant.py), each read as it is stored and widened to float32 in registers. It
takes float32 queries (the CPU's compute dtype for every model without native bf16, a GGUF's
quantized weights included: the default) or bf16 ones (a bf16 model on a CPU with native
bf16, whose prefills attend in bf16): those are widened, and the output narrowed, in the
call. Decodes there gain float32's accuracy with the kernel's speed: one token's attention
reads the same bf16 bytes either way, bf16 products would save only the widening (which
the AVX512 passes share among a KV head's query heads), and torch's bf16 SDPA over the
workspace pays its fixed cost per slot and head. ``supports`` says where it runs; elsewhere (no C
compiler, ``KVFLOW_NATIVE_KERNELS=0``, ``--no-paged-attention``) decodes keep the gather or
the workspace.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from kvflow.engine_worker.model.kv_quant import QUANTIZED_DTYPES, SCALE_BYTES, is_quantized
from kvflow.engine_worker.model.native_build import build_library, one_openmp_runtime

#: Query heads per KV head the kernel takes (its stack buffers; Llama-3-70B has 8).
MAX_GROUP = 16
_WITHOUT = "decode attention gathers the paged cache and runs SDPA"
#: The query (and output) dtypes it takes: float32 as they are, bf16 widened.
QUERY_DTYPES = (torch.float32, torch.bfloat16)
# The cache dtypes the kernel reads, as its KIND_* numbers (cpu_paged.c).
KINDS: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
if "fp8" in QUANTIZED_DTYPES:
    KINDS[QUANTIZED_DTYPES["fp8"]] = 3


def _kernel() -> tuple[Callable[..., int], bool] | None:
    """The compiled function and whether it may use torch's threads (one OpenMP runtime)."""
    return build_kernel(())


@cache
def build_kernel(flags: tuple[str, ...]) -> tuple[Callable[..., int], bool] | None:
    """``_kernel`` built with extra compiler ``flags`` (the tests' ``-mno-avx512f``: the AVX2
    passes on a CPU whose own build takes AVX512's for the narrow cache dtypes)."""
    library = build_library(Path(__file__).with_name("cpu_paged.c"), ("-fopenmp", *flags),
                            without=_WITHOUT)  # fmt: skip
    if library is None:
        return None
    function = library.paged_decode
    function.restype = ctypes.c_int32
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i32, ptr, i64, ptr, ptr, i64,
                         i64, i64, i64, i64, i64, i64, ctypes.c_float, i32]  # fmt: skip
    return function, one_openmp_runtime()


def supports(device: torch.device, kv_cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> bool:
    """Whether decodes on ``device`` over a cache of ``kv_cache_dtype``, attended in
    ``compute_dtype`` (attention.compute_dtype), go through this kernel."""
    return (
        device.type == "cpu"
        and kv_cache_dtype in KINDS
        and compute_dtype in QUERY_DTYPES
        and _kernel() is not None
    )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per row of ``q`` ``[B, H, D]`` attending to its context in the cache.

    ``kv_cache`` is one layer's cache (``paged_cache.kv_cache_shape``) of a dtype in
    ``KINDS``, this step's K/V already written; ``block_ids`` ``[B, max_blocks]`` int64, the
    rows' block tables (entries past a row's context are never read); ``context_lens``
    ``[B]`` int64, the tokens each row attends to (at least 1). ``q`` is float32 or bf16;
    the kernel computes in float32 either way. Returns ``[B, H, D]`` in ``q``'s dtype."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError(f"no native paged decode kernel: {_WITHOUT} instead")
    function, shared = kernel
    batch, num_heads, head_dim = q.shape
    _, block_size, _, num_kv_heads, width = kv_cache.shape
    kind = KINDS.get(kv_cache.dtype)
    if q.dtype not in QUERY_DTYPES or kind is None or not q.is_cpu:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in KINDS)
        raise ValueError(
            f"the CPU paged kernel takes float32 or bfloat16 queries over a cache of {kinds}: "
            f"q {q.dtype}, cache {kv_cache.dtype}"
        )
    narrow = q.dtype
    if narrow != torch.float32:
        q = q.float()  # [B, H, D]: a few KB a layer
    cache_dim = width - SCALE_BYTES if is_quantized(kv_cache.dtype) else width
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or cache_dim != head_dim:
        raise ValueError("the CPU paged kernel reads dense head rows")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads")
    if block_ids.dtype != torch.int64 or block_ids.stride(1) != 1 or block_ids.shape[0] != batch:
        raise ValueError("block tables are [batch, blocks] int64 rows")
    if context_lens.dtype != torch.int64 or not context_lens.is_contiguous():
        raise ValueError("context lengths are dense int64")
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    size = kv_cache.element_size()  # the kernel's cache strides are in bytes
    stride_block, stride_token, stride_kv, stride_head, _ = (n * size for n in kv_cache.stride())
    threads = torch.get_num_threads() if shared else 1
    status = function(
        q.data_ptr(), q.stride(0), q.stride(1), kv_cache.data_ptr(), stride_block, stride_token,
        stride_kv, stride_head, kind, block_ids.data_ptr(), block_ids.stride(0),
        context_lens.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1), batch, num_heads,
        num_kv_heads, head_dim, block_size, scale, threads,
    )  # fmt: skip
    if status == -2:
        raise MemoryError("cpu_paged: no memory for the attention scores")
    assert status == 0, f"cpu_paged refused its arguments ({status})"
    return out if narrow == torch.float32 else out.to(narrow)
