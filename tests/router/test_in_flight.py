"""Placement's memory of what it just sent: a prompt's blocks count as held by the worker
it was placed on until that worker's STORED events confirm them or the TTL passes
(routing/in_flight.py, wired through BlockIndex and Placement)."""

from __future__ import annotations

import random
from dataclasses import replace

from kvflow.proto.block_hash import BlockHash, block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_hasher import CachedBlockHasher, PromptHashes
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS
from kvflow.router.routing.in_flight import InFlightBlocks
from kvflow.router.routing.pipeline import BLOCK_WEIGHTS
from kvflow.router.routing.placement import (
    MAX_IN_FLIGHT_BLOCKS,
    DisaggregationConfig,
    Placement,
    PlacementRequest,
    build_placement,
    max_in_flight_blocks,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId, WorkerView

SEED = make_hash_seed("m")
A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")
# A 6,000-token prefix (375 blocks) shared by a group, then a question of 10 blocks.
PREFIX = list(range(6000))


def prompt(question: int) -> list[int]:
    return PREFIX + [100_000 + question] * 160


def hashes(tokens: list[int]) -> list[BlockHash]:
    return block_hashes(tokens, block_size=16, seed=SEED)


def blocks(*values: int) -> list[BlockHash]:
    return [BlockHash(v) for v in values]


# -- InFlightBlocks ------------------------------------------------------------------------


def test_a_record_lasts_until_confirmed_or_expired() -> None:
    f = InFlightBlocks()
    f.add(0, blocks(1, 2), until_s=5.0)
    f.add(1, blocks(2), until_s=6.0)
    assert f.masks == {1: 0b01, 2: 0b11} and len(f) == 3
    f.confirm(0, BlockHash(2))  # slot 0 stored block 2; slot 1's record stays
    assert f.masks == {1: 0b01, 2: 0b10}
    f.confirm(0, BlockHash(9))  # never in flight: nothing happens
    f.expire(4.9)
    assert len(f) == 2
    f.expire(5.0)
    assert f.masks == {2: 0b10}
    f.expire(6.0)
    assert f.masks == {} and len(f) == 0


def test_a_later_placement_of_the_same_block_keeps_it_past_the_first_ttl() -> None:
    f = InFlightBlocks()
    f.add(0, blocks(1, 2), until_s=5.0)
    f.add(0, blocks(1), until_s=8.0)
    f.expire(5.0)
    assert f.masks == {1: 0b01}  # block 2 expired with the first placement, 1 was renewed
    f.expire(8.0)
    assert f.masks == {}


def test_forget_drops_one_worker_only() -> None:
    f = InFlightBlocks()
    f.add(0, blocks(1, 2), until_s=5.0)
    f.add(3, blocks(2, 3), until_s=5.0)
    f.forget(3)
    assert f.masks == {1: 0b1, 2: 0b1}
    f.expire(5.0)  # the forgotten placement's queue entry is skipped cleanly
    assert f.masks == {}


def test_memory_is_bounded_oldest_placement_first() -> None:
    f = InFlightBlocks(max_records=4)
    f.add(0, blocks(1, 2), until_s=5.0)
    f.add(1, blocks(3, 4), until_s=5.0)
    f.add(2, blocks(5, 6), until_s=5.0)  # 6 records: the first placement goes early
    assert sorted(f.masks) == [3, 4, 5, 6]


# -- BlockIndex ----------------------------------------------------------------------------


def test_the_index_matches_blocks_in_flight_until_events_take_over() -> None:
    index = BlockIndex()
    prompt_hashes = hashes(prompt(0))
    index.add(A, prompt_hashes[:100])  # a's events: the first 100 blocks
    index.add_in_flight(B, prompt_hashes[:200], until_s=5.0)
    assert index.match_prefix(prompt_hashes, [A, B, C]) == {A: 100, B: 200, C: 0}
    # Confirmed and in flight add up: a chunked prefill stores the prefix chunk by chunk.
    index.add_in_flight(A, prompt_hashes[:300], until_s=5.0)
    assert index.num_in_flight() == 200 + 200  # a's 100 stored blocks were not recorded
    assert index.match_prefix(prompt_hashes, [A]) == {A: 300}
    # b stores its blocks: the index holds them and the in-flight records are gone, so a
    # later eviction is seen as one, whatever the TTL says.
    index.add(B, prompt_hashes[:200])
    assert index.num_in_flight() == 200
    index.remove(B, prompt_hashes[150:200])
    assert index.match_prefix(prompt_hashes, [B]) == {B: 150}
    index.expire_in_flight(5.0)
    assert index.num_in_flight() == 0
    assert index.match_prefix(prompt_hashes, [A, B]) == {A: 100, B: 150}


def test_a_snapshot_or_a_worker_leaving_forgets_what_was_in_flight_to_it() -> None:
    index = BlockIndex()
    prompt_hashes = hashes(prompt(0))
    index.add_in_flight(A, prompt_hashes[:10], until_s=5.0)
    index.add_in_flight(B, prompt_hashes[:10], until_s=5.0)
    index.replace(A, [])  # a restarted: its requests are gone
    index.drop_worker(B)
    assert index.num_in_flight() == 0
    assert index.match_prefix(prompt_hashes, [A, B]) == {A: 0, B: 0}


# -- Placement -----------------------------------------------------------------------------


def view(name: str, queue: int = 0) -> WorkerView:
    return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, queue, 0.0)


def placement(index: BlockIndex, ttl_s: float = 5.0) -> Placement:
    return build_placement(BLOCK_WEIGHTS, DisaggregationConfig(), index=index,
                           sessions=SessionTable(), rng=random.Random(0),
                           in_flight_ttl_s=ttl_s)  # fmt: skip


def place(p: Placement, tokens: list[int], queues: dict[str, int], now_s: float | None) -> str:
    request = PlacementRequest("m", hashes(tokens), len(tokens), 16)
    plan = p.plan(request, [view(name, q) for name, q in queues.items()], now_s)
    assert plan is not None
    return plan.stream_worker


def test_a_burst_on_a_new_prefix_follows_its_first_request() -> None:
    p = placement(BlockIndex())
    # Nothing cached: the first goes to any idle worker, and the next two, placed before
    # any KV event, to the same one (375 blocks in flight outweigh a request or two queued).
    first = place(p, prompt(0), {"a": 0, "b": 0, "c": 0}, now_s=0.0)
    queues = {"a": 0, "b": 0, "c": 0, first: 1}
    assert place(p, prompt(1), queues, now_s=0.1) == first
    queues[first] = 2
    assert place(p, prompt(2), queues, now_s=0.2) == first
    # A different prefix is not pulled there.
    assert place(p, list(range(50_000, 56_000)), queues, now_s=0.3) != first


def test_without_a_clock_or_with_ttl_0_the_burst_scatters() -> None:
    for p, now_s in ((placement(BlockIndex()), None), (placement(BlockIndex(), 0.0), 0.0)):
        spread = {place(p, prompt(i), {"a": 0, "b": 0, "c": 0}, now_s) for i in range(3)}
        assert spread == {"a", "b", "c"}  # least recently chosen: no reason to stay


def test_an_unconfirmed_placement_stops_counting_after_its_ttl() -> None:
    index = BlockIndex()
    p = placement(index, ttl_s=2.0)
    first = place(p, prompt(0), {"a": 0, "b": 0}, now_s=0.0)
    assert index.num_in_flight() == len(hashes(prompt(0)))
    assert place(p, prompt(1), {"a": 0, "b": 0}, now_s=1.9) == first
    # Two seconds after the last placement its worker has still stored nothing (the
    # requests failed): the other worker, chosen less recently, takes the next one.
    assert place(p, prompt(2), {"a": 0, "b": 0}, now_s=3.9) != first
    assert index.num_in_flight() == len(hashes(prompt(0)))


def test_the_load_gate_still_spills_a_burst() -> None:
    p = placement(BlockIndex())
    first = place(p, prompt(0), {"a": 0, "b": 0, "c": 0}, now_s=0.0)
    # Its queue (20) is over the line (mean 7 x 1.5 + 4 = 14.5): the prefix goes elsewhere.
    others = sorted({"a", "b", "c"} - {first})
    queues = {first: 20, others[0]: 1, others[1]: 0}
    assert place(p, prompt(1), queues, now_s=0.1) == others[1]


def test_recording_a_prompt_does_not_grow_the_hash_memo() -> None:
    hasher = CachedBlockHasher()
    index = BlockIndex()
    p = placement(index)
    tokens = prompt(0)
    request = PlacementRequest("m", PromptHashes(hasher, tokens, 16, SEED), len(tokens), 16)
    assert p.plan(request, [view("a"), view("b")], now_s=0.0) is not None
    assert index.num_in_flight() == len(hashes(tokens))
    assert len(hasher) == 0  # nothing held anywhere yet: nothing worth remembering
    # The next request of the burst walks the in-flight blocks, and those it walks past
    # are remembered (the 375 of the shared prefix matched, the 376th hashed to find the
    # end).
    request = PlacementRequest("m", PromptHashes(hasher, prompt(1), 16, SEED), len(tokens), 16)
    plan = p.plan(request, [view("a"), view("b")], now_s=0.1)
    assert plan is not None and plan.matched_blocks == len(PREFIX) // 16
    assert len(hasher) == len(PREFIX) // 16


def test_a_long_prompt_is_remembered_up_to_a_second_of_prefill() -> None:
    """The time scorer values a claim at the prefill it saves: the whole prompt is
    remembered up to the load gate's slack of prefill (placement.IN_FLIGHT_PREFILL_S),
    2,307 blocks at the default step costs, and no further."""
    assert max_in_flight_blocks(DEFAULT_STEP_COSTS, 16) == MAX_IN_FLIGHT_BLOCKS == 2307
    index = BlockIndex()
    p = placement(index)
    long_prompt = list(range(200_000, 250_000))  # 3,125 blocks
    place(p, long_prompt, {"a": 0, "b": 0}, now_s=0.0)
    assert index.num_in_flight() == MAX_IN_FLIGHT_BLOCKS
    # Slower prefill, fewer tokens to the second: the limit follows the step costs.
    slow = replace(
        DEFAULT_STEP_COSTS, timing=replace(DEFAULT_STEP_COSTS.timing, per_prefill_token_s=1e-4)
    )
    assert max_in_flight_blocks(slow, 16) == 625
