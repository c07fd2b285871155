"""The paged KV cache of one layer: its layout, the write of a step's keys and values into
their slots, and the gather of whole blocks back out (attention.py attends over them).

The cache of one layer is a tensor ``[num_blocks, block_size, 2, num_kv_heads, head_dim]``
(see ``kv_cache_shape``): block-major, so one block's keys and values of every head are one
contiguous run (64 KiB for Llama-3-8B in bf16) that a KV transfer moves in one piece, and
neighbouring block ids merge into longer runs. A token's *slot* is
``block_id * block_size + offset``; viewing the cache as
``[num_slots, 2, num_kv_heads, head_dim]`` makes writes one ``index_copy_`` of whole token
rows for K and one for V, and reads one ``index_select`` of whole blocks.

A quantized cache (``--kv-cache-dtype int8|fp8``, kv_quant.py) stores one-byte values and a
scale per token and head; ``write_kv`` quantizes, the gathers dequantize.
"""

from __future__ import annotations

import torch

from kvflow.engine_worker.model.kv_quant import (
    gather_dequantized,
    is_quantized,
    row_width,
    write_quantized,
)


def kv_cache_shape(
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | None = None,
) -> tuple[int, int, int, int, int]:
    """The shape of one layer's cache: block-major, keys and values side by side per token.

    Tokens outside and K/V inside (rather than ``[num_blocks, 2, ...]``) is what lets a gather
    of whole blocks feed SDPA with no second copy: the gathered ``[blocks, block_size]``
    merge into one token axis, and K and V are strided views of it. A quantized ``dtype``
    widens each head's row by its scale (kv_quant.py): a block stays one contiguous run.
    """
    width = head_dim if dtype is None else row_width(head_dim, dtype)
    return (num_blocks, block_size, 2, num_kv_heads, width)


def write_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Store this step's keys and values ``[num_tokens, 2, num_kv_heads, head_dim]`` in their
    slots; return them as attention must read them: ``kv`` itself, or for a quantized cache
    what the cache now holds, dequantized to ``kv``'s dtype.

    A token's K and V of every head are one row of the cache, as they are of ``kv`` (the
    model hands over the tail of its fused QKV projection): one ``index_copy_`` of whole
    rows, not one for K and one for V."""
    num_blocks, block_size, _, num_kv_heads, head_dim = kv_cache.shape
    if is_quantized(kv_cache.dtype):
        return write_quantized(kv_cache, kv, slot_mapping)
    slots = kv_cache.view(num_blocks * block_size, 2 * num_kv_heads * head_dim)
    rows = kv.reshape(kv.shape[0], 2 * num_kv_heads * head_dim)
    slots.index_copy_(0, slot_mapping, rows.to(kv_cache.dtype))
    return kv


def gather_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    dtype: torch.dtype,
    first_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the blocks' first ``num_tokens`` tokens, ``[..., Hkv, num_tokens, D]``.

    ``block_ids`` is ``[num_blocks]`` or ``[B, num_blocks]``. One ``index_select`` copies
    whole blocks (one memcpy each); the result is ``[..., tokens, 2, Hkv, D]`` and K and V are
    strided views of it, which SDPA takes as they are (the last axis is contiguous). With
    ``first_block`` (one sequence whose blocks are consecutive) the same views are of the
    cache itself: no copy. Against the former head-major pool (one 4 KiB tile per head and
    block), 16 decodes over 400 tokens, fp32, 2 busy cores (noisy): SmolLM2's shape (3 KV
    heads of 64) gather + SDPA 1.0-1.9 vs 1.3-3.2 ms, 8 heads of 64 3.1-5.1 vs 3.6-5.4 ms;
    the engine's decode throughput is unchanged within noise. (CPU SDPA in bf16 with 8 heads
    of 128 ran slower on these strided views, 75 vs 40 ms, with an earlier torch: why the
    CPU attended in float32 then; ``attention.compute_dtype`` says where it still does.)
    """
    if is_quantized(kv_cache.dtype):
        return gather_dequantized(kv_cache, block_ids, num_tokens, dtype, first_block)
    _, block_size, _, num_kv_heads, head_dim = kv_cache.shape
    if first_block is not None:
        # The views below, made in one call each: at batch 1 every view op costs a few us.
        row = 2 * num_kv_heads * head_dim  # one token's K and V
        start = kv_cache.storage_offset() + first_block * block_size * row
        lead = block_ids.shape[:-1]  # () or (1,)
        size = (*lead, num_kv_heads, num_tokens, head_dim)
        stride = (*(0 for _ in lead), head_dim, row, 1)
        keys = kv_cache.as_strided(size, stride, start)
        values = kv_cache.as_strided(size, stride, start + num_kv_heads * head_dim)
        return keys.to(dtype), values.to(dtype)
    kv = kv_cache.index_select(0, block_ids.reshape(-1))  # [B * n, block_size, 2, Hkv, D]
    kv = kv.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, 2, num_kv_heads, head_dim)
    kv = kv.narrow(-4, 0, num_tokens)  # [..., tokens, 2, Hkv, D]
    kv = kv.movedim(-3, 0).transpose(-3, -2)  # [2, ..., Hkv, tokens, D]
    kv = kv.to(dtype)
    return kv[0], kv[1]
