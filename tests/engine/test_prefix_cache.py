"""Exact expectations for prefix caching through the KV cache manager."""

from kvflow.engine_worker.core.kv_cache_manager import KVCacheManager
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.proto.block_hash import block_hashes

BS = 4
SEED = b"test-model"


def make(rid: str, tokens: list[int], salt: str = "", public: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), 0.0, cache_salt=salt, num_public_blocks=public)


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """Admit a request the way the scheduler does; returns (block ids, cached tokens)."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.commit(req, req.num_tokens)
    return kv.block_ids(req.request_id), num_hit


def test_second_request_reuses_the_shared_prefix_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, hash_seed=SEED)
    a = make("a", list(range(10)))  # blocks [0..4), [4..8), partial [8, 9]
    ids_a, hit_a = admit(kv, a)
    assert (ids_a, hit_a) == ([0, 1, 2], 0)
    assert kv.pool.num_cached_blocks == 2
    assert a.block_hashes == block_hashes(list(range(10)), block_size=BS, seed=SEED)

    b = make("b", list(range(8)) + [50, 51, 52])
    ids_b, hit_b = admit(kv, b)
    assert (ids_b, hit_b) == ([0, 1, 3], 8)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]


def test_the_last_token_is_never_served_from_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, hash_seed=SEED)
    admit(kv, make("a", list(range(8))))
    b = make("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4


def test_freed_prefix_survives_until_evicted_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, hash_seed=SEED)
    a = make("a", list(range(16)))
    admit(kv, a)
    kv.free(a)
    # Freed tail-first: the last block is the first eviction candidate.
    assert kv.pool.free_queue_ids() == [3, 2, 1, 0]
    b = make("b", [99] * 5)  # needs 2 fresh blocks: evicts blocks 3 then 2
    admit(kv, b)
    c = make("c", list(range(16)) + [1])
    _, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8  # blocks 0 and 1 survived


def test_salt_isolates_tenants_and_public_blocks_are_shared() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS, hash_seed=SEED)
    prompt = list(range(13))
    admit(kv, make("a", prompt, salt="tenant-a", public=1))
    assert kv.get_computed_blocks(make("x", prompt, salt="tenant-a", public=1))[1] == 12
    assert kv.get_computed_blocks(make("y", prompt, salt="tenant-b", public=1))[1] == 4
    assert kv.get_computed_blocks(make("z", prompt))[1] == 4
    assert kv.get_computed_blocks(make("w", prompt, salt="tenant-a"))[1] == 0


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, hash_seed=SEED)
    a = make("a", list(range(8)))
    admit(kv, a)
    b = make("b", list(range(8)) + list(range(100, 108)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # needs 2 more blocks beyond the 2 hits, only 1 free
    assert kv.allocate_slots(b, 8, hits) is None
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 0]
    assert kv.block_ids("b") == []


def test_reviving_free_cached_hits_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS, hash_seed=SEED)
    a = make("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # 3 free: two cached, one empty
    b = make(
        "b", list(range(8)) + [7] * 9
    )  # 2 hits + needs 3 more blocks: only 1 left after reviving
    hits, _ = kv.get_computed_blocks(b)
    assert len(hits) == 2
    assert kv.allocate_slots(b, 9, hits) is None
    assert kv.pool.num_free_blocks == 3


def test_prefix_hit_rate_counts_prompt_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, hash_seed=SEED)
    admit(kv, make("a", list(range(9))))
    admit(kv, make("b", list(range(9))))
    assert kv.stats.num_queried_tokens == 18
    assert kv.stats.num_hit_tokens == 8


def _collide(req: Request, hashes: list) -> Request:  # type: ignore[type-arg]
    """A request whose block hashes are forced to ``hashes``: a 64-bit collision cannot
    be found by search, so the test makes one."""
    req.block_hashes[:] = hashes
    return req


def test_a_hash_collision_is_a_miss_not_someone_elses_kv() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, hash_seed=SEED)
    a = make("a", list(range(12)), salt="tenant-a")
    admit(kv, a)
    # Other tokens under the same hashes: the first block's tokens differ.
    b = _collide(make("b", list(range(100, 113)), salt="tenant-a"), list(a.block_hashes))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.stats.num_hash_mismatches == 1
    # The same tokens under another tenant's salt: the salt is part of the identity.
    c = _collide(make("c", list(range(12)) + [7], salt="tenant-b"), list(a.block_hashes))
    assert kv.get_computed_blocks(c) == ([], 0)
    # Equal first block, a later block differs: the hit stops before it.
    d_tokens = list(range(4)) + [200, 201, 202, 203] + list(range(8, 12)) + [7]
    d = _collide(make("d", d_tokens, salt="tenant-a"), list(a.block_hashes))
    hits, num_hit = kv.get_computed_blocks(d)
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4
    assert kv.stats.num_hash_mismatches == 3
    # And the honest request still hits all three blocks.
    e = make("e", list(range(12)) + [7], salt="tenant-a")
    assert kv.get_computed_blocks(e)[1] == 12
