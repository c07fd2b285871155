"""Decode attention that reads K/V straight from the paged cache: a Triton kernel for GPUs.

The CPU path (``attention._decode``) gathers every sequence's blocks into a copy padded to
the longest context and runs SDPA on it. On a GPU that copy is pure cost: one extra write
and read of every context token per step and layer, plus the padding. This kernel instead
walks each sequence's block table and reads each of its tokens once, in place, with an
online softmax (flash-decoding):

- one program per (sequence, KV head, split): it loads the ``H / Hkv`` query heads that
  share the KV head and attends them together, so a KV head is read once (GQA);
- a context is cut into up to ``num_splits`` runs of whole blocks, each program returning
  its run's normalised output and log-sum-exp; ``paged_decode`` merges the runs. Splits
  keep a GPU busy at small batches (batch 1 of 8 KV heads is 8 programs otherwise, on 132
  SMs); their number depends only on the tensors' shapes, so a CUDA graph can hold it;
- a quantized cache (kv_quant.py: int8 or fp8 values and a float16 scale at the end of
  each row) is dequantized as it is loaded, in float32.

Scores and accumulators are float32 whatever the cache's dtype. Only decodes (one new token
per sequence) go through it; prefill chunks keep the gather and SDPA, whose copy is
amortised over their many query tokens. Triton compiles only for GPUs: ``attention`` picks
this path on CUDA devices alone. Tests run the same kernel on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), tests/engine/test_triton_paged.py.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kvflow.engine_worker.model.kv_quant import SCALE_BYTES, SCALE_DTYPE, is_quantized

# Programs to aim for before splitting contexts: a few waves of an H200's 132 SMs.
TARGET_PROGRAMS = 512
# A split reads at least this many blocks: shorter runs cost more in the merge than they
# win in parallelism.
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 32


# Kernel arguments stay unannotated: Triton reads annotations as its own types.
@triton.jit  # type: ignore[untyped-decorator]
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    cache_ptr,
    scale_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    sm_scale,
    blocks_per_split,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ckv,
    stride_ch,
    stride_sb,
    stride_st,
    stride_skv,
    stride_sh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    BLOCK_SIZE: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
    HEAD_DIM: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
    D_PAD: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
    GROUP: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
    G_PAD: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
    QUANT: tl.constexpr,  # noqa: N803 (Triton spells constexprs so)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    first = s * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = h * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q * sm_scale

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    lsum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j in range(first, last):
        block = tl.load(table_ptr + b * stride_tb + j).to(tl.int64)
        tok_ok = j * BLOCK_SIZE + t < ctx
        row = block * stride_cb + t[:, None] * stride_ct + h * stride_ch + d[None, :]
        ld_mask = tok_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + row, mask=ld_mask, other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + row + stride_ckv, mask=ld_mask, other=0.0).to(tl.float32)
        if QUANT:
            # The float16 scale sits after the row's HEAD_DIM one-byte values.
            srow = block * stride_sb + t * stride_st + h * stride_sh + HEAD_DIM // 2
            k_scale = tl.load(scale_ptr + srow, mask=tok_ok, other=0.0).to(tl.float32)
            v_scale = tl.load(scale_ptr + srow + stride_skv, mask=tok_ok, other=0.0).to(tl.float32)
            k = k * k_scale[:, None]
            v = v * v_scale[:, None]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BLOCK_SIZE]
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    # A split past the end of its context attended nothing: output 0, weight exp(-inf) = 0.
    has = lsum > 0
    out = acc / tl.where(has, lsum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("-inf"))
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + d[None, :],
        out,
        mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=g_ok)


def num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """How many runs to cut each context into: enough programs to fill the GPU, each run at
    least MIN_BLOCKS_PER_SPLIT blocks. A function of the shapes alone (CUDA graphs)."""
    by_length = max(1, max_blocks // MIN_BLOCKS_PER_SPLIT)
    by_occupancy = max(1, -(-TARGET_PROGRAMS // (batch * num_kv_heads)))
    return min(by_length, by_occupancy, MAX_SPLITS)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """One query token per row of ``q`` ``[B, H, D]`` attending to its context in the cache.

    ``kv_cache`` is one layer's cache (``paged_cache.kv_cache_shape``), its step's K/V already
    written; ``block_ids`` ``[B, max_blocks]`` the rows' block tables (entries past a row's
    context are never read); ``context_lens`` ``[B]`` the tokens each row attends to.
    Returns ``[B, H, D]`` in ``q``'s dtype. ``splits``: the runs per context (None: chosen
    from the shapes by ``num_splits``).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, _, num_kv_heads, _ = kv_cache.shape
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    max_blocks = block_ids.shape[1]
    count = splits or num_splits(batch, num_kv_heads, max_blocks)
    per_split = -(-max_blocks // count)
    quant = is_quantized(kv_cache.dtype)
    # The cache's rows seen as float16 words: the scale is word HEAD_DIM / 2 of a quantized
    # row. For a float cache the pointer is unused; the cache itself stands in for it.
    scales = kv_cache.view(torch.uint8).view(SCALE_DTYPE) if quant else kv_cache
    if quant:
        assert head_dim % 2 == 0 and SCALE_BYTES == 2
    out = torch.empty((batch, num_heads, count, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_heads, count), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads, count)](
        q,
        kv_cache,
        scales,
        block_ids,
        context_lens,
        out,
        lse,
        scale,
        per_split,
        q.stride(0),
        q.stride(1),
        *kv_cache.stride()[:4],
        *scales.stride()[:4],
        block_ids.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        GROUP=group,
        G_PAD=max(triton.next_power_of_2(group), 1),
        QUANT=quant,
    )
    if count == 1:
        return out[:, :, 0].to(q.dtype)
    # Merge the runs: each weighted by its share of the softmax's denominator.
    weights = torch.softmax(lse, dim=-1).unsqueeze(-1)  # [B, H, S, 1]
    return (out * weights).sum(dim=2).to(q.dtype)
