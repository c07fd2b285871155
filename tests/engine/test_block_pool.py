"""Exact expectations for the block pool: ids, reference counts, eviction order, events."""

import pytest

from kvflow.engine_worker.core.block_pool import BlockPool
from kvflow.engine_worker.core.kv_events import KvEvent, KvEventKind
from kvflow.proto.block_hash import BlockHash

H = BlockHash


def test_allocates_from_the_head_in_id_order() -> None:
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert pool.usage == 0.75


def test_empty_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, H(10))
    pool.cache_block(b, H(11))
    pool.free([b, a, c, d])  # c and d hold nothing: they go to the head
    assert pool.free_queue_ids() == [3, 2, 1, 0]
    assert [x.block_id for x in pool.allocate(2)] == [3, 2]
    assert pool.num_cached_blocks == 2


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block, h in zip(blocks, (H(1), H(2), H(3)), strict=True):
        pool.cache_block(block, h)
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[1]])
    pool.events.drain()
    taken = pool.allocate(2)
    assert [b.block_id for b in taken] == [2, 0]
    assert pool.get_cached_block(H(3)) is None and pool.get_cached_block(H(1)) is None
    assert pool.get_cached_block(H(2)) is blocks[1]
    assert pool.events.drain() == [KvEvent(1 + 1, KvEventKind.REMOVED, (H(3), H(1)))]


def test_touch_revives_a_free_cached_block_and_shares_it() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, H(7))
    pool.free([a])
    assert pool.num_free_blocks == 2
    hit = pool.get_cached_block(H(7))
    assert hit is a
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 1
    pool.free([a])
    assert pool.num_free_blocks == 1  # still referenced once
    pool.free([a])
    assert pool.num_free_blocks == 2 and pool.get_cached_block(H(7)) is a


def test_a_hash_is_cached_once() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, H(5)) is True
    assert pool.cache_block(b, H(5)) is False
    assert b.block_hash is None and pool.num_cached_blocks == 1


def test_double_free_is_a_bug() -> None:
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])


def test_events_are_numbered_and_merged_per_kind() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, H(1))
    pool.cache_block(b, H(2))
    pool.free([a, b])
    pool.allocate(1)
    assert pool.events.drain() == [
        KvEvent(1, KvEventKind.STORED, (H(1), H(2))),
        KvEvent(2, KvEventKind.REMOVED, (H(1),)),
    ]
    assert pool.events.last_seq == 2 and pool.events.drain() == []


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, H(1))
    assert pool.reset_prefix_cache() is False
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.events.drain()[-1].kind is KvEventKind.CLEARED
