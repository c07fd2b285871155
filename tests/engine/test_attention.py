"""Paged attention equals plain causal attention over the same tokens."""

import torch
import torch.nn.functional as F
from testkit.attend import attend

from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

H, HKV, D, BS, NB = 4, 2, 8, 4, 32


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a whole sequence, [T, H, D]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return o.transpose(0, 1)


def test_chunked_and_batched_decode_match_full_attention() -> None:
    g = torch.Generator().manual_seed(0)
    lens = [11, 6, 9]
    tables = [[5, 2, 9], [0, 7], [30, 1, 3]]  # deliberately scattered blocks
    seqs = [
        (
            torch.randn(n, H, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
        )
        for n in lens
    ]
    cache = torch.zeros(kv_cache_shape(num_blocks=NB, block_size=BS, num_kv_heads=HKV, head_dim=D))
    scale = D**-0.5

    # Step 1: prefill each sequence except its last token, in chunks of different sizes.
    chunk_plan = [[0, 4, 10], [0, 5], [0, 3, 8]]
    outs: list[list[torch.Tensor]] = [[] for _ in lens]
    for step in range(2):
        q_parts, k_parts, v_parts, qlens, ctxs, tbls, who = [], [], [], [], [], [], []
        for i, plan in enumerate(chunk_plan):
            if step + 1 < len(plan):
                a, b = plan[step], plan[step + 1]
                q, k, v = seqs[i]
                q_parts.append(q[a:b])
                k_parts.append(k[a:b])
                v_parts.append(v[a:b])
                qlens.append(b - a)
                ctxs.append(b)
                tbls.append(tables[i])
                who.append(i)
        meta = AttentionMetadata.build(
            query_lens=qlens, context_lens=ctxs, block_tables=tbls, block_size=BS
        )
        o = attend(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), cache, meta, scale)
        row = 0
        for i, n in zip(who, qlens, strict=True):
            outs[i].append(o[row : row + n])
            row += n

    # Step 2: every sequence decodes its last token, all in one batch.
    q_parts, k_parts, v_parts, ctxs = [], [], [], []
    for i, n in enumerate(lens):
        done = chunk_plan[i][-1]
        assert done == n - 1
        q, k, v = seqs[i]
        q_parts.append(q[done:])
        k_parts.append(k[done:])
        v_parts.append(v[done:])
        ctxs.append(n)
    meta = AttentionMetadata.build(
        query_lens=[1, 1, 1], context_lens=ctxs, block_tables=tables, block_size=BS
    )
    assert len(meta.decodes) == 1 and not meta.prefills
    o = attend(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), cache, meta, scale)
    for i in range(3):
        outs[i].append(o[i : i + 1])

    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(torch.cat(outs[i]), reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_many_decodes_are_grouped_by_length_and_stay_exact() -> None:
    g = torch.Generator().manual_seed(1)
    lens = [3 + (7 * i) % 45 for i in range(20)]
    cache = torch.zeros(
        kv_cache_shape(num_blocks=NB * 8, block_size=BS, num_kv_heads=HKV, head_dim=D)
    )
    free = torch.randperm(NB * 8, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    seqs = [
        (
            torch.randn(n, H, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
        )
        for n in lens
    ]
    scale = D**-0.5
    # Prefill everything but the last token, then decode all 20 at once.
    meta = AttentionMetadata.build(
        query_lens=[n - 1 for n in lens],
        context_lens=[n - 1 for n in lens],
        block_tables=tables,
        block_size=BS,
    )
    attend(
        torch.cat([q[:-1] for q, _, _ in seqs]),
        torch.cat([k[:-1] for _, k, _ in seqs]),
        torch.cat([v[:-1] for _, _, v in seqs]),
        cache,
        meta,
        scale,
    )
    meta = AttentionMetadata.build(
        query_lens=[1] * 20, context_lens=lens, block_tables=tables, block_size=BS
    )
    assert len(meta.decodes) == 3  # 20 sequences, at least 8 per group
    o = attend(
        torch.cat([q[-1:] for q, _, _ in seqs]),
        torch.cat([k[-1:] for _, k, _ in seqs]),
        torch.cat([v[-1:] for _, _, v in seqs]),
        cache,
        meta,
        scale,
    )
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(o[i], reference(q, k, v)[-1], atol=1e-5, rtol=1e-5)


def _prefill_then_decode(
    tables: list[list[int]], lens: list[int], *, cached: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], AttentionMetadata]:
    """Write all but the last token of each sequence (``cached`` of them in an earlier step,
    the rest as a chunk over that context), then decode the last one; return each
    sequence's prefill-chunk output, its decode output and the decode step's metadata."""
    g = torch.Generator().manual_seed(2)
    cache = torch.zeros(
        kv_cache_shape(num_blocks=NB * 8, block_size=BS, num_kv_heads=HKV, head_dim=D)
    )
    seqs = [
        (
            torch.randn(n, H, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g),
        )
        for n in lens
    ]
    refs = [reference(q, k, v) for q, k, v in seqs]
    chunks: list[torch.Tensor] = []
    for i, (q, k, v) in enumerate(seqs):
        for a, b in ((0, cached), (cached, lens[i] - 1)):
            if b > a:
                meta = AttentionMetadata.build(
                    query_lens=[b - a], context_lens=[b], block_tables=[tables[i]], block_size=BS
                )
                o = attend(q[a:b], k[a:b], v[a:b], cache, meta, D**-0.5)
        chunks.append(o - refs[i][cached : lens[i] - 1])
    meta = AttentionMetadata.build(
        query_lens=[1] * len(lens), context_lens=lens, block_tables=tables, block_size=BS
    )
    o = attend(
        torch.cat([q[-1:] for q, _, _ in seqs]),
        torch.cat([k[-1:] for _, k, _ in seqs]),
        torch.cat([v[-1:] for _, _, v in seqs]),
        cache,
        meta,
        D**-0.5,
    )
    return chunks, [o[i] - refs[i][-1] for i in range(len(lens))], meta


def test_consecutive_blocks_are_read_in_place_and_stay_exact() -> None:
    # Consecutive blocks are sliced out of the cache, scattered ones gathered: both exact,
    # and a table that is only nearly consecutive (a gap) must not be taken for one run.
    for table, in_place in (([8, 9, 10, 11], True), ([8, 9, 11, 12], False), ([3], True)):
        n = len(table) * BS - 1
        chunks, decodes, meta = _prefill_then_decode([table], [n], cached=min(BS, n - 2))
        (d,) = meta.decodes
        assert (d.first_block == table[0]) is in_place
        assert d.rows is None and d.mask is None  # one sequence: no row gather, no padding
        for err in chunks + decodes:
            assert err.abs().max() < 1e-5


def test_equal_length_decodes_need_no_mask() -> None:
    tables = [[0, 1, 2], [5, 4, 3], [20, 30, 7]]
    _, decodes, meta = _prefill_then_decode(tables, [10, 10, 10])
    (d,) = meta.decodes
    assert d.mask is None and d.first_block is None and d.rows is None
    for err in decodes:
        assert err.abs().max() < 1e-5
