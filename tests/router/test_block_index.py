"""The block index: exact prefix matches, events, snapshots, restarts and the bound."""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvflow.proto.block_hash import BlockHash, block_hashes, make_hash_seed
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.types import WorkerId

A, B, C = WorkerId("a:1"), WorkerId("b:1"), WorkerId("c:1")
SEED = make_hash_seed("test-model")


def hashes(tokens: list[int], salt: str = "") -> list[BlockHash]:
    return block_hashes(tokens, block_size=4, seed=SEED, salt=salt)


PROMPT = list(range(40))  # 10 blocks of 4
H = hashes(PROMPT)


def test_match_counts_leading_blocks_only() -> None:
    index = BlockIndex()
    index.add(A, H[:6])
    index.add(B, H[:2] + H[3:8])  # a hole at block 2: only 2 leading blocks count
    index.add(C, H[5:])  # no first block: nothing counts
    assert index.match_prefix(H, [A, B, C]) == {A: 6, B: 2, C: 0}
    assert index.match_prefix(H, [B]) == {B: 2}
    assert index.match_prefix(H, []) == {}


def test_unknown_workers_match_zero() -> None:
    index = BlockIndex()
    index.add(A, H)
    assert index.match_prefix(H, [A, WorkerId("new:1")]) == {A: 10, WorkerId("new:1"): 0}


def test_match_consumes_hashes_lazily() -> None:
    index = BlockIndex()
    index.add(A, H[:3])
    consumed = []

    def lazy() -> Iterator[BlockHash]:
        for h in H:
            consumed.append(h)
            yield h

    assert index.match_prefix(lazy(), [A]) == {A: 3}
    assert len(consumed) == 4  # three hits and the first miss, not all ten
    consumed.clear()
    assert index.match_prefix(lazy(), [B]) == {B: 0}
    assert consumed == []  # nobody indexed: nothing hashed at all


def test_removed_and_cleared_events() -> None:
    index = BlockIndex()
    index.add(A, H)
    index.add(B, H)
    index.remove(A, [H[4]])
    assert index.match_prefix(H, [A, B]) == {A: 4, B: 10}
    index.remove(A, [BlockHash(12345)])  # unknown hashes are ignored
    index.clear(B)
    assert index.match_prefix(H, [A, B]) == {A: 4, B: 0}
    assert index.num_blocks(B) == 0
    assert len(index) == 9  # B's blocks were dropped; A still holds 9


def test_snapshot_replaces_what_was_known() -> None:
    index = BlockIndex()
    index.add(A, H)
    other = hashes(list(range(100, 140)))
    index.replace(A, other[:3])  # a restarted worker's snapshot
    assert index.match_prefix(H, [A]) == {A: 0}
    assert index.match_prefix(other, [A]) == {A: 3}
    assert len(index) == 3


def test_dropped_worker_frees_its_slot_for_a_new_one() -> None:
    index = BlockIndex()
    index.add(A, H)
    index.add(B, H[:2])
    index.drop_worker(A)
    assert len(index) == 2
    index.add(C, H[:5])  # reuses A's slot: must not inherit A's blocks
    assert index.match_prefix(H, [A, B, C]) == {A: 0, B: 2, C: 5}


def test_bound_drops_oldest_blocks_first() -> None:
    index = BlockIndex(max_blocks_per_worker=4)
    index.add(A, H[:6])
    assert index.num_blocks(A) == 4
    # Blocks 0 and 1 were oldest: A no longer matches any prefix of the prompt.
    assert index.match_prefix(H, [A]) == {A: 0}
    assert index.match_prefix(H[2:], [A]) == {A: 4}


def test_salted_prompts_do_not_match_other_tenants() -> None:
    index = BlockIndex()
    index.add(A, hashes(PROMPT, salt="tenant-1"))
    assert index.match_prefix(hashes(PROMPT, salt="tenant-2"), [A]) == {A: 0}
    assert index.match_prefix(hashes(PROMPT, salt="tenant-1"), [A]) == {A: 10}


def test_many_workers_randomized_against_a_naive_model() -> None:
    rng = random.Random(7)
    index = BlockIndex()
    workers = [WorkerId(f"w{i}:1") for i in range(70)]  # more than 64: multi-word masks
    held: dict[WorkerId, set[BlockHash]] = {w: set() for w in workers}
    for _ in range(500):
        w = rng.choice(workers)
        chosen = rng.sample(H, rng.randint(1, 5))
        if rng.random() < 0.7:
            index.add(w, chosen)
            held[w].update(chosen)
        else:
            index.remove(w, chosen)
            held[w].difference_update(chosen)
    expected = {}
    for w in workers:
        n = 0
        while n < len(H) and H[n] in held[w]:
            n += 1
        expected[w] = n
    assert index.match_prefix(H, workers) == expected
