"""Attention over a paged KV cache: the one function a GPU kernel would replace.

The cache of one layer is a tensor ``[num_blocks, block_size, 2, num_kv_heads, head_dim]``
(see ``kv_cache_shape``): block-major, so one block's keys and values of every head are one
contiguous run (64 KiB for Llama-3-8B in bf16) that a KV transfer moves in one piece, and
neighbouring block ids merge into longer runs. A token's *slot* is
``block_id * block_size + offset``; viewing the cache as
``[num_slots, 2, num_kv_heads, head_dim]`` makes writes one ``index_copy_`` of whole token
rows for K and one for V, and reads one ``index_select`` of whole blocks.

On the CPU the simple path wins: gather each sequence's blocks into contiguous K/V and
call ``scaled_dot_product_attention``. Sequences with more than one new token (prefill
chunks) go one at a time; single-token decodes go in padded batches, because padding costs
far less than a Python loop over 64 SDPA calls. Decodes are sorted by context length and cut
into up to ``MAX_DECODE_GROUPS`` batches of similar lengths: one batch padded to the longest
of 64 contexts spread over 64..512 tokens gathers about 1.8x the tokens it uses; four
batches, about 1.15x.

That gather copies every decoding sequence's whole context, each step and layer, to add one
token to it. With a decode workspace (``decode_workspace.py``, the runner's choice) the
decodes instead read dense per-sequence copies kept across steps: filled from the cache
once, then one token appended per step, and one SDPA over all of them.

On a GPU, decodes skip the gather: the Triton kernel of ``triton_paged.py`` walks each
sequence's block table and reads its tokens in place (``uses_paged_kernel`` picks it on CUDA
devices; the CPU never runs it). Prefill chunks keep the gather and SDPA there too: their
copy is shared by all their query tokens.

On the CPU attention computes in float32 whatever the model's dtype (``compute_dtype``): the
cache keeps the model's dtype, and a bf16 model's K/V are widened as they are read.

A quantized cache (``--kv-cache-dtype int8|fp8``, kv_quant.py) stores one-byte values and a
scale per token and head; ``write_kv`` quantizes, the gathers dequantize, and the step's own
tokens are attended as the cache stores them (dequantized), so that every path, whichever
copy of a token it reads, sees the same values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import ModuleType

import torch
import torch.nn.functional as F

from kvflow.engine_worker.model.decode_workspace import WorkspaceStep
from kvflow.engine_worker.model.kv_quant import (
    gather_dequantized,
    is_quantized,
    row_width,
    write_quantized,
)

MAX_DECODE_GROUPS = 4
# Below 8 sequences a group's padding costs less than another SDPA call and gather.
MIN_DECODE_GROUP = 8


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention computes in, for a model in ``dtype`` on ``device``.

    float32 on the CPU: torch's CPU SDPA runs one-token queries 2-3x slower in bf16 than in
    float32 over the same tokens (64 decodes of 8 heads over 300-500 tokens: 6.4-11.9 ms
    against 3.1-4.5; 1.1x with SmolLM2's 3 x 3 grouped heads; ``bench/decode_micro.py``),
    while its bf16 GEMMs run about 4x faster than float32 on a CPU with AVX512-BF16. A bf16
    model on the CPU therefore runs its matmuls in bf16 and its attention in float32
    (widening bf16 is exact). Elsewhere the model's own dtype.
    """
    return torch.float32 if device.type == "cpu" else dtype


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with ``query_len`` new tokens at the end of ``context_len`` tokens."""

    query_start: int  # row of its first new token in the flattened batch
    query_len: int
    context_len: int  # tokens it attends to, the new ones included
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64
    first_block: int | None = None  # its blocks are consecutive from here: a view, no gather


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token each, padded to the longest context."""

    rows: torch.Tensor | None  # [B] int64: their rows in the flattened batch; None: all, in order
    block_ids: torch.Tensor  # [B, max_blocks] int64 (padding points at block 0)
    num_tokens: int  # the longest context: tokens gathered per sequence
    # [B, 1, 1, num_tokens] bool, True where a real token is; None when no row is padded.
    mask: torch.Tensor | None
    first_block: int | None = None  # one sequence on consecutive blocks from here: no gather
    # [B] int64: each row's context; set on CUDA, where the paged kernel reads it instead of
    # a gather and a mask (triton_paged.py).
    context_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: the slot each new token's K/V is written to
    prefills: tuple[PrefillSeq, ...]
    decodes: tuple[DecodeBatch, ...]
    # Decodes served from dense per-sequence copies (decode_workspace.py) instead of
    # ``decodes``; ``layer_kv`` is this layer's (keys, values) of them (see ``layer``).
    workspace: WorkspaceStep | None = None
    layer_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer(self, index: int) -> AttentionMetadata:
        """The metadata as layer ``index`` reads it: with its own workspace tensors."""
        if self.workspace is None:
            return self
        return replace(self, layer_kv=self.workspace.layers[index])

    @staticmethod
    def build(
        *,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        workspace: WorkspaceStep | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences laid out one after another in the flattened batch.

        Sequence ``i`` has ``query_lens[i]`` new tokens, the last of its
        ``context_lens[i]`` tokens, stored in the blocks ``block_tables[i]``. With a
        ``workspace`` (planned for exactly the one-token rows), those rows attend through
        it and get no ``DecodeBatch``.
        """
        assert len(query_lens) == len(context_lens) == len(block_tables)
        # Slot of each new token: position p of a sequence lives in block table[p // B]
        # at offset p % B. Plain Python: for decodes (one token each) it beats tensor ops.
        slots: list[int] = []
        for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            assert len(table) * block_size >= ctx, "block table too short for the context"
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)
            )
        slot_mapping = torch.tensor(slots, dtype=torch.int64)

        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            used = table[: -(-ctx // block_size)]
            if q == 1 and workspace is not None:
                pass  # served by the workspace
            elif q == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(ctx)
            else:
                ids = torch.tensor(used, dtype=torch.int64, device=device)
                prefills.append(PrefillSeq(row, q, ctx, ids, _first_if_consecutive(used)))
            row += q

        decodes: list[DecodeBatch] = []
        order = sorted(range(len(decode_rows)), key=lambda i: decode_lens[i])
        group_size = -(-len(order) // MAX_DECODE_GROUPS) if order else 1
        group_size = max(group_size, MIN_DECODE_GROUP)
        kernel = uses_paged_kernel(torch.device(device), block_size)
        if kernel:  # the kernel reads each row's own tokens: one batch, no padding to cut
            group_size = max(group_size, len(order))
        # The rows of a single group that holds every token of the step, in order, need no
        # gather from q nor scatter into the output (a pure decode step of one group).
        all_rows = len(decode_rows) == row and len(order) <= group_size
        for start in range(0, len(order), group_size):
            members = order[start : start + group_size]
            if all_rows:
                members = list(range(len(order)))
            lens = [decode_lens[i] for i in members]
            max_blocks = max(len(decode_tables[i]) for i in members)
            # One padded table, built in Python and converted once.
            padded = [
                decode_tables[i] + [0] * (max_blocks - len(decode_tables[i])) for i in members
            ]
            longest = max(lens)
            mask = None
            if min(lens) != longest and not kernel:
                positions = torch.arange(longest)
                mask = (positions[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
                mask = mask.to(device)
            first = _first_if_consecutive(padded[0]) if len(members) == 1 else None
            rows = None
            if not all_rows:
                rows = torch.tensor([decode_rows[i] for i in members], dtype=torch.int64)
                rows = rows.to(device)
            decodes.append(
                DecodeBatch(
                    rows=rows,
                    block_ids=torch.tensor(padded, dtype=torch.int64, device=device),
                    num_tokens=longest,
                    mask=mask,
                    first_block=None if kernel else first,
                    context_lens=(
                        torch.tensor(lens, dtype=torch.int64, device=device) if kernel else None
                    ),
                )
            )
        return AttentionMetadata(
            slot_mapping.to(device), tuple(prefills), tuple(decodes), workspace=workspace
        )


def uses_paged_kernel(device: torch.device, block_size: int) -> bool:
    """Whether decodes on ``device`` attend through the paged Triton kernel (triton_paged.py)
    rather than a gather and SDPA: on CUDA devices, when Triton imports and the block size
    is a power of two (the kernel's token axis). Never on the CPU: Triton compiles for GPUs."""
    if device.type != "cuda" or block_size & (block_size - 1):
        return False
    return _triton_paged() is not None


@functools.cache
def _triton_paged() -> ModuleType | None:
    """The kernel's module, imported on first use on a GPU (None: Triton is missing)."""
    try:
        from kvflow.engine_worker.model import triton_paged
    except ImportError:
        return None
    return triton_paged


def _first_if_consecutive(table: list[int]) -> int | None:
    """The first block id if ``table`` is a run of consecutive ids (a fresh pool hands them
    out so), else None: such blocks are one slice of the cache, read with no copy."""
    first = table[0]
    return (
        first
        if table[-1] - first == len(table) - 1 and table == list(range(first, first + len(table)))
        else None
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


def _gather(
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
    of 128 ran slower on these strided views, 75 vs 40 ms: one reason the CPU attends in
    float32, ``compute_dtype``.)
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
    if q.dtype != wide:
        return paged_attention(q.to(wide), kv.to(wide), kv_cache, meta, scale).to(q.dtype)
    kv = write_kv(kv_cache, kv, meta.slot_mapping)  # as the cache holds them
    k, v = kv[:, 0], kv[:, 1]
    is_gqa = q.shape[1] != kv_cache.shape[3]  # [blocks, block_size, 2, Hkv, D]
    ws = meta.workspace
    if not meta.prefills and len(meta.decodes) == 1 and meta.decodes[0].rows is None:
        return _decode(q, kv_cache, meta.decodes[0], scale)  # a pure decode step: no scatter
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
            ks, vs = _gather(kv_cache, seq.block_ids, seq.context_len, q.dtype, seq.first_block)
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
    """One token per sequence ``q`` ``[B, H, D]`` attending to its gathered context, or on a
    GPU (``d.context_lens`` set) to its context read in place by the paged kernel.

    Grouped-query heads are folded into the query axis: the ``H / Hkv`` heads that share a
    KV head are that head's query rows (``[B, Hkv, H / Hkv, D]``), so SDPA reads each K/V
    head once and needs no ``enable_gqa`` expansion (SmolLM2's 9 over 3 heads, 64
    decodes over 160 tokens: about 10-40 % less time, noisy)."""
    if d.context_lens is not None:
        kernel = _triton_paged()
        assert kernel is not None, "context_lens are set only where the kernel runs"
        out: torch.Tensor = kernel.paged_decode(q, kv_cache, d.block_ids, d.context_lens, scale)
        return out
    kd, vd = _gather(kv_cache, d.block_ids, d.num_tokens, q.dtype, d.first_block)
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
        ks, vs = _gather(kv_cache, fill.block_ids, fill.num_tokens, wk.dtype)  # [Hkv, n, D]
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
