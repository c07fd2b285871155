"""Attention over a paged KV cache: the one function a GPU kernel would replace.

The cache's layout, its writes and its gathers are paged_cache.py's; the step's metadata
(which tokens go where, how decodes are batched) attention_metadata.py's.

On the CPU the simple path wins: gather each sequence's blocks into contiguous K/V and
call ``scaled_dot_product_attention``. Sequences with more than one new token (prefill
chunks) go one at a time; single-token decodes go in padded batches of similar context
lengths (attention_metadata.py).

That gather copies every decoding sequence's whole context, each step and layer, to add one
token to it. With a decode workspace (``decode_workspace.py``, the runner's choice) the
decodes instead read dense per-sequence copies kept across steps: filled from the cache
once, then one token appended per step, and one SDPA over all of them.

Where a paged kernel runs, decodes skip the gather: it walks each sequence's block table
and reads its tokens in place: on a GPU the Triton kernel of ``triton_paged.py``, on the CPU
the C kernel of ``cpu_paged.py``, in float32 whatever the compute dtype (the runner's choice,
``paged_kernel.py``; with it the runner keeps no workspace). Prefill chunks keep the gather
and SDPA: their copy is shared by all their query tokens.

On a CPU with native bf16 (AMX or AVX512-BF16) a bf16 model attends in bf16; elsewhere the
CPU attends in float32 whatever the model's dtype (``compute_dtype``): the cache keeps the
model's dtype, and a bf16 model's K/V are widened as they are read.

A quantized cache (``--kv-cache-dtype int8|fp8``, kv_quant.py) stores one-byte values and a
scale per token and head; ``write_kv`` quantizes, the gathers dequantize, and the step's own
tokens are attended as the cache stores them (dequantized), so that every path, whichever
copy of a token it reads, sees the same values.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.engine_worker.auto_dtype import CPU_BF16_FLAGS, cpu_flags
from kvflow.engine_worker.model import cpu_paged
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata, DecodeBatch
from kvflow.engine_worker.model.decode_workspace import WorkspaceStep
from kvflow.engine_worker.model.kv_quant import is_quantized
from kvflow.engine_worker.model.paged_cache import gather_kv, write_kv
from kvflow.engine_worker.model.paged_kernel import triton_paged_module


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention computes in, for a model in ``dtype`` on ``device``.

    On a GPU, and for a bf16 model on a CPU that multiplies bf16 natively (``avx512_bf16`` or
    ``amx_bf16``), the model's own dtype. (The CPU's paged kernel, the default for decodes,
    computes in float32 either way: it takes bf16 queries and returns bf16, cpu_paged.py; so
    this is the dtype of prefill chunks' SDPA, and of decodes where the kernel does not run.)
    There torch's CPU SDPA (flash attention: float32
    accumulation and softmax, bf16 products) runs one-token queries over the decode
    workspace's slots at 0.5-1.1x float32's time (SmolLM2's 3 KV heads of 64 with 3 query
    rows each: 0.75-0.88x; 8 heads of 64: 0.47x; 16 slots of 150-400 tokens, 1 thread,
    torch 2.15 on a Xeon with AMX), reads half the bytes, and needs no widening of Q, K
    and V nor narrowing of the output (copies: a fifth of a batch-64 bf16 step's profile,
    these casts among them). Its tolerance against float32 attention, and SmolLM2's greedy
    tokens, are ``tests/engine/test_bf16_attention.py``'s.

    Float32 on any other CPU, where bf16 arithmetic is emulated, and for float16 (widening
    is exact). An earlier torch ran bf16 SDPA at 2-3x float32's time even on a CPU with
    AVX512-BF16 (64 decodes of 8 heads over 300-500 tokens: 6.4-11.9 ms against 3.1-4.5,
    ``bench/decode_micro.py``); rerun it on a new torch before trusting either rule.
    """
    if device.type != "cpu":
        return dtype
    if dtype == torch.bfloat16 and cpu_has_native_bf16():
        return dtype
    return torch.float32


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 ``avx512_bf16`` or ``amx_bf16``, as
    /proc/cpuinfo lists them; elsewhere, or unreadable: no)."""
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False
    return bool(CPU_BF16_FLAGS & flags)


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each new token to its context.

    ``q`` is ``[num_tokens, num_heads, head_dim]``; ``kv`` is this step's keys and values
    side by side, ``[num_tokens, 2, num_kv_heads, head_dim]``, as the cache stores a token.
    Returns ``[num_tokens, num_heads, head_dim]``.
    Grouped-query attention shares each KV head among ``num_heads / num_kv_heads`` heads.
    ``kv_cache`` has the shape ``kv_cache_shape`` gives.
    """
    wide = compute_dtype(q.dtype, q.device)
    if q.dtype != wide and is_quantized(kv_cache.dtype):
        # Dequantized straight to the compute dtype, as the gathers read the cache.
        kv = kv.to(wide)
    # A dense cache takes this step's K/V in the model's dtype (no round trip through
    # float32); what attention reads of them is widened after.
    kv = write_kv(kv_cache, kv, meta.slot_mapping)  # as the cache holds them
    if q.dtype != wide:
        return _attend(q.to(wide), kv.to(wide), kv_cache, meta, scale).to(q.dtype)
    return _attend(q, kv, kv_cache, meta, scale)


def _attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` once this step's K/V ``kv`` are in the cache, in ``q``'s dtype."""
    if not meta.prefills and len(meta.decodes) == 1 and meta.decodes[0].rows is None:
        return _decode(q, kv_cache, meta.decodes[0], scale)  # a pure decode step: no scatter
    k, v = kv[:, 0], kv[:, 1]
    is_gqa = q.shape[1] != kv_cache.shape[3]  # [blocks, block_size, 2, Hkv, D]
    ws = meta.workspace
    if ws is not None and not meta.prefills and not meta.decodes and ws.rows is None:
        return _decode_workspace(q, k, v, kv_cache, ws, meta.layer_kv, scale)
    out = torch.empty_like(q)

    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        qs = q[rows].transpose(0, 1)  # [H, q, D]
        if seq.query_len == seq.context_len:
            # No cached context: attend to this step's own keys, no gather needed.
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=is_gqa
            )
        else:
            # New token i sits at position context_len - query_len + i and sees keys up to it.
            ks, vs = gather_kv(kv_cache, seq.block_ids, seq.context_len, q.dtype, seq.first_block)
            first = seq.context_len - seq.query_len
            q_pos = torch.arange(first, seq.context_len, device=q.device)[:, None]
            k_pos = torch.arange(seq.context_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=k_pos <= q_pos, scale=scale, enable_gqa=is_gqa
            )
        out[seq.query_start : seq.query_start + seq.query_len] = o.transpose(0, 1)

    if ws is not None:
        assert ws.rows is not None, "a workspace of every row goes alone"
        out[ws.rows] = _decode_workspace(
            q[ws.rows], k[ws.rows], v[ws.rows], kv_cache, ws, meta.layer_kv, scale
        )
    for d in meta.decodes:
        qd = q if d.rows is None else q[d.rows]
        o = _decode(qd, kv_cache, d, scale)
        if d.rows is None:
            out.copy_(o)
        else:
            out[d.rows] = o
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeBatch, scale: float) -> torch.Tensor:
    """One token per sequence ``q`` ``[B, H, D]`` attending to its gathered context, or
    (``d.context_lens`` set) to its context read in place by a paged kernel: Triton's on a
    GPU, cpu_paged.c on the CPU.

    Grouped-query heads are folded into the query axis: the ``H / Hkv`` heads that share a
    KV head are that head's query rows (``[B, Hkv, H / Hkv, D]``), so SDPA reads each K/V
    head once and needs no ``enable_gqa`` expansion (SmolLM2's 9 over 3 heads, 64
    decodes over 160 tokens: about 10-40 % less time, noisy)."""
    if d.context_lens is not None:
        if q.is_cpu:
            return cpu_paged.paged_decode(q, kv_cache, d.block_ids, d.context_lens, scale)
        kernel = triton_paged_module()
        assert kernel is not None, "context_lens are set only where the kernel runs"
        out: torch.Tensor = kernel.paged_decode(q, kv_cache, d.block_ids, d.context_lens, scale)
        return out
    kd, vd = gather_kv(kv_cache, d.block_ids, d.num_tokens, q.dtype, d.first_block)
    return _attend_grouped(q, kd, vd, d.mask, scale)


def _attend_grouped(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query token per row of ``q`` ``[B, H, D]`` over ``keys`` and ``values``
    ``[B, Hkv, T, D]``, the ``H / Hkv`` heads of a KV head folded into its query rows."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(batch, num_heads, head_dim)


def _decode_workspace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    ws: WorkspaceStep,
    layer_kv: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
) -> torch.Tensor:
    """``_decode`` over the dense slots of decode_workspace.py: move the slots the plan
    compacts, fill the ones it says are new or stale from the paged cache, reorder them if
    it sorts them, append this step's K/V ``[B, Hkv, D]``, then one SDPA per run of slots
    (``ws.groups``), each over its own longest context. Row ``i`` of ``q`` is slot
    ``slots[i]``."""
    assert layer_kv is not None, "metadata with a workspace is read through meta.layer(i)"
    wk, wv = layer_kv
    for move in ws.moves:
        wk[move.dst, :, : move.num_tokens].copy_(wk[move.src, :, : move.num_tokens])
        wv[move.dst, :, : move.num_tokens].copy_(wv[move.src, :, : move.num_tokens])
    for fill in ws.fills:
        ks, vs = gather_kv(kv_cache, fill.block_ids, fill.num_tokens, wk.dtype)  # [Hkv, n, D]
        wk[fill.slot, :, : fill.num_tokens].copy_(ks)
        wv[fill.slot, :, : fill.num_tokens].copy_(vs)
    if ws.permutation is not None:
        # The right side is a copy (advanced indexing): no slot is overwritten before read.
        held, n = ws.permutation.shape[0], ws.permute_tokens
        wk[:held, :, :n] = wk[ws.permutation, :, :n]
        wv[:held, :, :n] = wv[ws.permutation, :, :n]
    # Advanced indices on axes 0 and 2 around a slice: the indexed view is [B, Hkv, D].
    wk[ws.slots, :, ws.positions] = k.to(wk.dtype)
    wv[ws.slots, :, ws.positions] = v.to(wv.dtype)
    if ws.identity:
        qs = q
    else:
        qs = q.new_zeros(ws.num_slots, *q.shape[1:])
        qs[ws.slots] = q
    outs = []
    for g in ws.groups:
        keys = wk[g.start : g.stop, :, : g.num_tokens].to(q.dtype)
        values = wv[g.start : g.stop, :, : g.num_tokens].to(q.dtype)
        outs.append(_attend_grouped(qs[g.start : g.stop], keys, values, g.mask, scale))
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    return o if ws.identity else o[ws.slots]
