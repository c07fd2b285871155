"""A hypothesis state machine on the KV cache manager and its block pool.

Requests arrive with prompts drawn from a small alphabet (so prefixes are shared and cache
hits happen), take their hits, allocate, compute in chunks, decode, and finish or are
preempted, in any order, on a pool small enough to evict and to refuse. After every step:

- each block's reference count equals the number of live requests holding it; no block
  is held twice by one request; a block held by two requests is a cached (shared) one;
- the free queue holds exactly the unreferenced blocks, each once (nothing leaked, nothing
  freed twice), and the counters (free, cached, usage) agree with it;
- the hash map and the blocks agree both ways, and the KV events drained so far, applied
  in order, give exactly the cached set (what a router's index is built from);
- a refused allocation changed nothing.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvflow.engine_worker.core.kv_cache_manager import KVCacheManager
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 48 tokens: three prompts of four blocks fill it, so eviction is common

PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=17)


class KvCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, hash_seed=b"s")
        self.pool = self.kv.pool
        self.live: dict[str, Request] = {}
        self.next_id = 0
        self.event_view: set[int] = set()
        self.last_seq = 0

    def _snapshot(self) -> tuple[object, ...]:
        return (
            self.pool.free_queue_ids(),
            sorted(self.pool.cached_hashes()),
            [(b.ref_cnt, b.block_hash) for b in self.pool.blocks],
            {rid: self.kv.block_ids(rid) for rid in self.live},
        )

    @rule(target=requests, prompt=PROMPTS, salt=st.sampled_from(["", "t1"]))
    def admit(self, prompt: list[int], salt: str) -> str:
        """The scheduler's admission: hits, then room for the rest of the prompt."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Request(rid, prompt, SamplingParams(), 0.0, cache_salt=salt)
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        assert num_hit_tokens < request.num_tokens  # the last token is always computed
        before = self._snapshot()
        num_new = request.num_tokens - num_hit_tokens
        if self.kv.allocate_slots(request, num_new, hits) is None:
            assert self._snapshot() == before, "a refused allocation changed the pool"
        else:
            request.num_computed_tokens = num_hit_tokens
            self.live[rid] = request
        return rid

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def compute(self, data: st.DataObject, chunk: int) -> None:
        """A step computes up to ``chunk`` tokens of a request; the KV is then written."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 0:
            return
        request.num_computed_tokens += min(chunk, remaining)
        self.kv.commit(request, request.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        """A fully computed request samples one token and needs a slot for it."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if request.num_computed_tokens < request.num_tokens:
            return
        request.token_ids.append(token)
        before = self._snapshot()
        if self.kv.allocate_slots(request, 1) is None:
            assert self._snapshot() == before, "a refused decode slot changed the pool"
            request.token_ids.pop()

    @rule(rid=consumes(requests))
    def finish(self, rid: str) -> None:
        """Finished, aborted or preempted: every block goes back (twice is harmless)."""
        request = self.live.pop(rid, None)
        if request is not None:
            self.kv.free(request)
            self.kv.free(request)  # the manager forgets the request: no double free

    @rule()
    def reset_cache(self) -> None:
        """Possible only when no block is referenced (every live request holds one)."""
        assert self.pool.reset_prefix_cache() is (not self.live)
        if not self.live:
            assert self.pool.num_cached_blocks == 0

    @invariant()
    def references_match_the_live_requests(self) -> None:
        held: Counter[int] = Counter()
        for rid in self.live:
            ids = self.kv.block_ids(rid)
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
            held.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == held[block.block_id], block
            if block.ref_cnt > 1:
                assert block.block_hash is not None, f"an uncached block is shared: {block}"

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self) -> None:
        free = self.pool.free_queue_ids()
        assert len(free) == len(set(free)), "a block is in the free queue twice"
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_cnt == 0}
        assert self.pool.num_free_blocks == len(free)
        assert abs(self.pool.usage - (1 - len(free) / NUM_BLOCKS)) < 1e-12

    @invariant()
    def hash_map_and_events_agree_with_the_blocks(self) -> None:
        cached = {b.block_hash: b for b in self.pool.blocks if b.block_hash is not None}
        assert sorted(cached) == sorted(self.pool.cached_hashes())
        assert self.pool.num_cached_blocks == len(cached)
        for block_hash, block in cached.items():
            assert self.pool.get_cached_block(block_hash) is block
        for event in self.pool.events.drain():
            assert event.seq == self.last_seq + 1, "KV events must be numbered without gaps"
            self.last_seq = event.seq
            if event.kind is KvEventKind.STORED:
                assert not set(event.block_hashes) & self.event_view, "stored twice"
                self.event_view |= set(event.block_hashes)
            elif event.kind is KvEventKind.REMOVED:
                assert set(event.block_hashes) <= self.event_view, "removed unknown"
                self.event_view -= set(event.block_hashes)
            else:
                self.event_view.clear()
        assert self.event_view == set(cached)

    def teardown(self) -> None:
        for request in list(self.live.values()):
            self.kv.free(request)
        assert self.pool.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


KvCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_manager_and_block_pool = KvCacheMachine.TestCase
