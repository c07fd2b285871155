"""The decode workspace: dense per-sequence K/V copies that decode attention reads instead
of gathering the paged cache each step.

The plan's bookkeeping is tested on its own (a slot is filled once, then appended to; a
released or preempted sequence's copy is never read again; holes are compacted; over the
budget it falls back to the gather path). Then many steps of random traffic (sequences
arriving, prefilling in chunks next to decodes, finishing, being preempted and
recomputed) run through ``paged_attention`` twice, with and without a workspace, over two
layers: every output must match. The engines' greedy parity with transformers runs with the
workspace on by default (tests/engine/test_generation_parity.py and
test_preemption_parity.py run both ways).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from testkit.attend import attend

from kvflow.engine_worker.model import decode_workspace
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_workspace import (
    CAPACITY_STEP_TOKENS,
    COMPACT_SLACK_SLOTS,
    Decode,
    DecodeWorkspace,
)
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

H, HKV, D, BS = 4, 2, 8, 4
LAYERS = 2


def workspace(max_bytes: int = 1 << 30, head_dim: int = D) -> DecodeWorkspace:
    return DecodeWorkspace(
        num_layers=LAYERS,
        num_kv_heads=HKV,
        head_dim=head_dim,
        block_size=BS,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_bytes=max_bytes,
    )


def decode(rid: str, row: int, ctx: int, final: int = 0) -> Decode:
    return Decode(rid, row, ctx, list(range(100, 100 + -(-ctx // BS))), final)


def test_runs_pad_to_their_own_longest_and_a_disordered_layout_is_sorted() -> None:
    """32 decodes alternating 10 and 100 tokens: four runs of 8 slots each pad to 100
    (3,232 tokens attended); in order of length, two runs pad to 11 and two to 101 (1,792),
    so the next step sorts the slots, and its runs read each group's own longest."""
    ws = workspace()
    lens = [10 if i % 2 else 100 for i in range(32)]
    step = ws.plan([decode(f"r{i}", i, n) for i, n in enumerate(lens)], all_rows=True)
    assert step is not None and step.permutation is None  # it grew: the sort waits
    assert [(g.start, g.stop, g.num_tokens) for g in step.groups] == [
        (a, a + 8, 100) for a in range(0, 32, 8)
    ]
    step = ws.plan([decode(f"r{i}", i, n + 1) for i, n in enumerate(lens)], all_rows=True)
    assert step is not None and step.permutation is not None
    # Slot i takes what slot permutation[i] held: the short ones first, in slot order.
    assert step.permutation.tolist() == list(range(1, 32, 2)) + list(range(0, 32, 2))
    assert step.permute_tokens == 101
    assert [(g.start, g.stop, g.num_tokens) for g in step.groups] == [
        (0, 8, 11),
        (8, 16, 11),
        (16, 24, 101),
        (24, 32, 101),
    ]
    assert step.slots.tolist() == [16 + i // 2 if i % 2 == 0 else i // 2 for i in range(32)]
    assert all(g.mask is None for g in step.groups)  # equal lengths within each run
    step = ws.plan([decode(f"r{i}", i, n + 2) for i, n in enumerate(lens)], all_rows=True)
    assert step is not None and step.permutation is None  # sorted stays sorted


def test_a_slot_is_filled_once_then_appended_to() -> None:
    ws = workspace()
    step = ws.plan([decode("a", 0, 10), decode("b", 1, 5)], all_rows=True)
    assert step is not None
    # Both are new: their cached tokens (all but this step's) are copied in once.
    assert [(f.slot, f.num_tokens) for f in step.fills] == [(0, 9), (1, 4)]
    assert step.slots.tolist() == [0, 1] and step.positions.tolist() == [9, 4]
    assert step.identity and step.num_tokens == 10
    (group,) = step.groups
    assert group.mask is not None and group.mask[1, 0, 0, 5:].eq(-torch.inf).all()
    step = ws.plan([decode("a", 0, 11), decode("b", 1, 6)], all_rows=True)
    assert step is not None and step.fills == ()  # one token appended each, nothing copied
    # A context that does not continue the copy (the sequence was recomputed shorter,
    # or a step was lost) is refilled rather than trusted.
    step = ws.plan([decode("a", 0, 9), decode("b", 1, 7)], all_rows=True)
    assert step is not None and [(f.slot, f.num_tokens) for f in step.fills] == [(0, 8)]


def test_a_lone_decode_gathers_and_its_copy_is_refilled_when_it_fell_behind() -> None:
    ws = workspace()
    ws.plan([decode("a", 0, 10), decode("b", 1, 5)], all_rows=True)
    assert ws.plan([decode("a", 0, 11)], all_rows=True) is None  # gathered, in place
    step = ws.plan([decode("a", 0, 12), decode("b", 1, 6)], all_rows=True)
    assert step is not None
    assert [(f.slot, f.num_tokens) for f in step.fills] == [(0, 11)]  # a's copy stopped at 10


def test_a_released_slot_goes_to_the_next_sequence_and_is_refilled() -> None:
    ws = workspace()
    ws.plan([decode("a", 0, 10), decode("b", 1, 5)], all_rows=True)
    ws.release("a")
    step = ws.plan([decode("c", 0, 7), decode("b", 1, 6)], all_rows=True)
    assert step is not None
    assert step.slots.tolist() == [0, 1]  # c took a's slot
    assert [(f.slot, f.num_tokens) for f in step.fills] == [(0, 6)]


def test_holes_past_the_slack_are_compacted() -> None:
    ws = workspace()
    n = COMPACT_SLACK_SLOTS + 12
    ws.plan([decode(f"r{i}", i, 20 + i) for i in range(n)], all_rows=True)
    for i in range(n - 4):
        ws.release(f"r{i}")
    survivors = [decode(f"r{i}", j, 21 + i) for j, i in enumerate(range(n - 4, n))]
    step = ws.plan(survivors, all_rows=True)
    assert step is not None
    assert step.num_slots == 4 and sorted(step.slots.tolist()) == [0, 1, 2, 3]
    assert [(m.src, m.dst) for m in step.moves] == [(n - 4, 0), (n - 3, 1), (n - 2, 2), (n - 1, 3)]
    assert [m.num_tokens for m in step.moves] == [20 + i for i in range(n - 4, n)]
    assert step.fills == ()  # moved, not refilled
    # A few holes under the slack are left alone: moving costs a copy of each context.
    ws.release(survivors[0].request_id)
    step = ws.plan(survivors[1:], all_rows=True)
    assert step is not None and step.moves == ()


def test_capacity_is_reserved_for_where_the_decodes_end_and_bounded_by_the_budget() -> None:
    ws = workspace()
    step = ws.plan([decode("a", 0, 10, final=300), decode("b", 1, 10)], all_rows=True)
    assert step is not None
    keys, _ = step.layers[0]
    assert keys.shape[2] == -(-300 // CAPACITY_STEP_TOKENS) * CAPACITY_STEP_TOKENS
    # A budget for 16 slots of 128 tokens and no more.
    small = workspace(max_bytes=16 * CAPACITY_STEP_TOKENS * ws.bytes_per_slot_token)
    assert small.plan([decode(f"r{i}", i, 50) for i in range(16)], all_rows=True) is not None
    # 17 slots do not fit: the step gathers, and the slots are dropped.
    assert small.plan([decode(f"r{i}", i, 51) for i in range(17)], all_rows=True) is None
    assert small.num_bytes == 0
    step = small.plan([decode("r0", 0, 52), decode("r1", 1, 52)], all_rows=True)
    assert step is not None
    assert [(f.slot, f.num_tokens) for f in step.fills] == [(0, 51), (1, 51)]
    # A reach past the budget reserves what fits, not nothing and not a refusal.
    roomy = workspace(max_bytes=16 * 3 * CAPACITY_STEP_TOKENS * ws.bytes_per_slot_token)
    step = roomy.plan([decode("a", 0, 10, final=100_000), decode("b", 1, 9)], all_rows=True)
    assert step is not None and step.layers[0][0].shape[::2] == (16, 3 * CAPACITY_STEP_TOKENS)


def test_a_grow_keeps_what_the_slots_hold_and_what_a_compaction_will_move() -> None:
    """A step can compact the slots and outgrow the capacity at once; the grow copies before
    the layers do the moves, so it must keep the data of slots already marked free."""
    ws = workspace()
    n = COMPACT_SLACK_SLOTS + 12
    step = ws.plan([decode(f"r{i}", i, 20 + i) for i in range(n)], all_rows=True)
    assert step is not None
    for keys, values in step.layers:  # what the layers' fills and appends would leave
        for i in range(n):
            keys[i, :, : 20 + i] = i
            values[i, :, : 20 + i] = -i
    old_tokens = step.layers[0][0].shape[2]
    for i in range(n - 4):
        ws.release(f"r{i}")
    survivors = [decode(f"r{i}", j, 21 + i) for j, i in enumerate(range(n - 4, n))]
    longer = decode("long", 4, old_tokens + 1)  # more tokens than a slot holds
    step = ws.plan([*survivors, longer], all_rows=True)
    assert step is not None and step.layers[0][0].shape[2] > old_tokens
    assert sorted(m.src for m in step.moves) == list(range(n - 4, n))
    for keys, values in step.layers:
        for m in step.moves:  # as attention runs them (_decode_workspace)
            keys[m.dst, :, : m.num_tokens] = keys[m.src, :, : m.num_tokens].clone()
            values[m.dst, :, : m.num_tokens] = values[m.src, :, : m.num_tokens].clone()
        for m in step.moves:
            assert keys[m.dst, :, : m.num_tokens].eq(m.src).all()
            assert values[m.dst, :, : m.num_tokens].eq(-m.src).all()
        # Past what any slot held, the new capacity is zeros (finite: SDPA reads it masked).
        assert keys[:, :, 20 + n :].eq(0).all() and values[:, :, 20 + n :].eq(0).all()


def test_capacity_reserved_ahead_costs_no_memory_until_the_slots_reach_it() -> None:
    """Reserving for where the decodes end must not write it all now: 64 slots of 4,096
    tokens are 512 MiB of capacity, and 64 contexts of 10 tokens touch a few MiB of it.
    (Resident memory from Linux's /proc: workers run on Linux.)"""
    ws = workspace(head_dim=64)  # 2 KiB a slot-token: the memory shows
    before = _resident_bytes()
    step = ws.plan([decode(f"r{i}", i, 10, final=4000) for i in range(64)], all_rows=True)
    assert step is not None and ws.num_bytes == 512 << 20
    for keys, values in step.layers:  # what a step writes: each slot's first tokens
        keys[:, :, :10] = 1.0
        values[:, :, :10] = 1.0
    assert _resident_bytes() - before < 64 << 20


def test_a_grow_writes_only_the_tokens_each_slot_holds() -> None:
    """A grow copies into fresh memory, and each page it writes costs a fault: one long
    context among short ones must not make it copy every slot to the long one's length."""
    ws = workspace(head_dim=64)  # 2 KiB a slot-token: the memory shows
    decodes = [decode("long", 0, 2000), *(decode(f"r{i}", i, 10) for i in range(1, 64))]
    step = ws.plan(decodes, all_rows=True)
    assert step is not None and step.layers[0][0].shape[2] == 2048
    for keys, values in step.layers:  # what the step's fills leave
        keys[0, :, :2000] = values[0, :, :2000] = 2.0
        keys[1:, :, :10] = values[1:, :, :10] = 1.0
    before = _resident_bytes()
    longer = [decode("long", 0, 2101), *(decode(f"r{i}", i, 11) for i in range(1, 64))]
    step = ws.plan(longer, all_rows=True)
    # 2,000 tokens of one slot and 10 of 63 are 4.5 MiB; every slot to 2,000 would be 250.
    assert step is not None and step.layers[0][0].shape[2] > 2048
    assert _resident_bytes() - before < 64 << 20
    for keys, values in step.layers:
        for t in (keys, values):
            assert t[0, :, :2000].eq(2.0).all() and t[0, :, 2000:].eq(0).all()
            assert t[1:64, :, :10].eq(1.0).all() and t[1:64, :, 10:].eq(0).all()
            assert t[64:].eq(0).all()


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Seq:
    def __init__(self, rid: str, length: int, gen: torch.Generator) -> None:
        self.rid = rid
        self.q = torch.randn(length, H, D, generator=gen)
        self.k = torch.randn(LAYERS, length, HKV, D, generator=gen)
        self.v = torch.randn(LAYERS, length, HKV, D, generator=gen)
        self.done = 0  # tokens whose K/V are in the cache
        self.blocks: list[int] = []


@pytest.mark.parametrize(
    ("cache_dtype", "sorts"),
    [
        (torch.float32, True),
        (torch.float32, False),
        (torch.int8, False),
        (torch.float8_e4m3fn, False),
    ],
)
def test_random_traffic_attends_exactly_as_the_gather_path(
    cache_dtype: torch.dtype, sorts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrivals, chunked prefills beside decodes, finishes, preemptions: 2 layers, each step
    run with a workspace and without one on copies of the same cache. A quantized cache's
    workspace holds what the cache holds, dequantized: the two paths still agree exactly.
    With ``sorts`` the slots are attended in runs and re-sorted by length as arrivals
    disorder them (a sort compacts too, so no compaction's moves are left); without, the
    layout is never sorted and compactions move slots."""
    if not sorts:
        monkeypatch.setattr(decode_workspace, "SORT_GAIN", float("inf"))
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 400
    shape = kv_cache_shape(
        num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV, head_dim=D, dtype=cache_dtype
    )
    caches = [[torch.zeros(shape, dtype=cache_dtype) for _ in range(LAYERS)] for _ in range(2)]
    ws = workspace()
    free = list(range(num_blocks))
    rnd.shuffle(free)
    live: list[Seq] = []
    counter = 0
    seen = {"fills": 0, "mixed": 0, "pure": 0, "preempted": 0, "runs": 0}
    seen |= {"sorts": 0} if sorts else {"moves": 0}
    for _ in range(120):
        while len(live) < 24 and rnd.random() < 0.5:
            live.append(Seq(f"s{counter}", rnd.randint(3, 40), gen))
            counter += 1
        if live and rnd.random() < 0.05:  # preempt one: blocks freed, recomputed later
            victim = rnd.choice([s for s in live if s.done] or live)
            free.extend(victim.blocks)
            victim.blocks, victim.done = [], 0
            ws.release(victim.rid)
            seen["preempted"] += 1
        batch: list[tuple[Seq, int]] = []
        budget = 24
        for s in live:
            todo = len(s.q) - s.done
            n = 1 if s.done and todo else min(todo, budget, rnd.randint(2, 9))
            if n <= 0 or budget < n:
                continue
            budget -= n
            need = -(-(s.done + n) // BS) - len(s.blocks)
            s.blocks.extend(free.pop() for _ in range(need))
            batch.append((s, n))
        if not batch:
            continue
        query_lens = [n for _, n in batch]
        context_lens = [s.done + n for s, n in batch]
        tables = [list(s.blocks) for s, _ in batch]
        rows, row = [], 0
        for n in query_lens:
            rows.append(row)
            row += n
        decodes = [
            Decode(s.rid, r, c, s.blocks, len(s.q))
            for (s, n), r, c in zip(batch, rows, context_lens, strict=True)
            if n == 1
        ]
        step = ws.plan(decodes, all_rows=len(decodes) == row)
        if step is not None:
            seen["moves" if not sorts else "sorts"] += (
                len(step.moves) if not sorts else step.permutation is not None
            )
            seen["fills"] += len(step.fills)
            seen["runs"] += len(step.groups) > 1
            seen["pure" if step.rows is None else "mixed"] += 1
        metas = [
            AttentionMetadata.build(
                query_lens=query_lens,
                context_lens=context_lens,
                block_tables=tables,
                block_size=BS,
                workspace=w,
            )
            for w in (None, step)
        ]
        for layer in range(LAYERS):
            q = torch.cat([s.q[s.done : s.done + n] for s, n in batch])
            k = torch.cat([s.k[layer, s.done : s.done + n] for s, n in batch])
            v = torch.cat([s.v[layer, s.done : s.done + n] for s, n in batch])
            outs = [
                attend(q, k, v, caches[i][layer], metas[i].layer(layer), D**-0.5) for i in range(2)
            ]
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        for s, n in batch:
            s.done += n
        for s in [s for s in live if s.done == len(s.q)]:
            if rnd.random() < 0.5:
                live.remove(s)
                free.extend(s.blocks)
                ws.release(s.rid)
    # Every path was taken, so a bug in any of them would have shown.
    assert all(seen[key] > 0 for key in seen), seen
