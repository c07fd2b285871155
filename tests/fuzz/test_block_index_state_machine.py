"""A hypothesis state machine on the router's block index, fed the way the router feeds it:
KV event batches through `KvEventFollower`, one per worker subscription.

Workers store, evict and clear blocks (numbered by the worker's own `KvEventLog`); their
batches reach the router, are lost on the way, arrive twice or from a worker's previous
life; workers restart (a new instance, an empty cache); the router drops and re-adds
workers, or restarts and rebuilds from snapshots. Whenever a worker's stream is in step
(every event since its last snapshot delivered), the index's view of it equals the
worker's truth; a lost, repeated or stale batch is always noticed at the next delivery,
and the snapshot of the resubscription puts the view right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvflow.engine_worker.core.kv_events import KvEvent, KvEventKind, KvEventLog
from kvflow.proto import worker_pb2 as pb
from kvflow.proto.block_hash import BlockHash
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.types import WorkerId
from kvflow.router.workers import kv_events
from kvflow.router.workers.kv_events import KvEventFollower

WORKERS = [WorkerId(f"w{i}") for i in range(3)]
HASHES = st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True)
UNIVERSE = range(1, 13)
_KINDS = {KvEventKind.STORED: pb.KV_EVENT_KIND_STORED, KvEventKind.REMOVED:
          pb.KV_EVENT_KIND_REMOVED, KvEventKind.CLEARED: pb.KV_EVENT_KIND_CLEARED}  # fmt: skip


@dataclass
class Worker:
    """A worker's truth: its cached hashes, and the numbered events it has yet to send."""

    instance: int = 0
    cached: set[int] = field(default_factory=set)
    log: KvEventLog = field(default_factory=KvEventLog)
    unsent: list[KvEvent] = field(default_factory=list)

    def emit(self, kind: KvEventKind, hashes: list[int]) -> None:
        if kind is KvEventKind.STORED:
            hashes = [h for h in hashes if h not in self.cached]
            self.cached |= set(hashes)
        elif kind is KvEventKind.REMOVED:
            hashes = [h for h in hashes if h in self.cached]
            self.cached -= set(hashes)
        else:
            self.cached.clear()
        self.log.record(kind, [BlockHash(h) for h in hashes])
        self.unsent += self.log.drain()

    def batch(self, events: list[KvEvent], instance: int | None = None) -> pb.KvEventBatch:
        out = pb.KvEventBatch(instance_id=f"i{self.instance if instance is None else instance}",
                              seq=events[-1].seq)  # fmt: skip
        for e in events:
            out.events.add(seq=e.seq, kind=_KINDS[e.kind], block_hashes=list(e.block_hashes))
        return out

    def snapshot(self) -> pb.KvEventBatch:
        return pb.KvEventBatch(
            instance_id=f"i{self.instance}",
            is_snapshot=True,
            seq=self.log.last_seq,
            snapshot_block_hashes=sorted(self.cached),
        )


class BlockIndexMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.workers = {w: Worker() for w in WORKERS}
        self.index = BlockIndex(max_blocks_per_worker=len(UNIVERSE))
        self.followers: dict[WorkerId, KvEventFollower] = {}
        self.in_step: dict[WorkerId, bool] = {}  # no event lost since the last snapshot
        self.sent: dict[WorkerId, list[KvEvent]] = {w: [] for w in WORKERS}  # already delivered
        for w in WORKERS:
            self._subscribe(w)

    def _subscribe(self, w: WorkerId) -> None:
        """A new subscription (what the follower's run() loop does after any failure): the
        worker sends a snapshot, then only events after it."""
        follower = KvEventFollower(w, client=None, index=self.index)  # type: ignore[arg-type]
        self.followers[w] = follower
        worker = self.workers[w]
        worker.unsent.clear()
        follower._apply(worker.snapshot())
        self.in_step[w] = True

    def _deliver(self, w: WorkerId, batch: pb.KvEventBatch, *, must_fail: bool) -> None:
        try:
            self.followers[w]._apply(batch)
        except kv_events._StreamOutOfStepError:
            assert must_fail, "an in-step batch was refused"
            self._subscribe(w)
            return
        assert not must_fail, "a gap, a repeat or a stale instance went unnoticed"

    @rule(w=st.sampled_from(WORKERS), kind=st.sampled_from(list(KvEventKind)), hashes=HASHES)
    def worker_caches(self, w: WorkerId, kind: KvEventKind, hashes: list[int]) -> None:
        self.workers[w].emit(kind, hashes)

    @precondition(lambda self: any(self.workers[w].unsent for w in self.followers))
    @rule(data=st.data(), lose=st.booleans(), size=st.integers(1, 3))
    def deliver(self, data: st.DataObject, lose: bool, size: int) -> None:
        w = data.draw(st.sampled_from([w for w in self.followers if self.workers[w].unsent]))
        worker = self.workers[w]
        events, worker.unsent = worker.unsent[:size], worker.unsent[size:]
        if lose:
            self.in_step[w] = False
            return
        self._deliver(w, worker.batch(events), must_fail=not self.in_step[w])
        self.sent[w] = events

    @precondition(lambda self: any(self.sent[w] and w in self.followers for w in WORKERS))
    @rule(data=st.data(), stale=st.booleans())
    def deliver_again_or_from_a_past_life(self, data: st.DataObject, stale: bool) -> None:
        w = data.draw(st.sampled_from([w for w in self.followers if self.sent[w]]))
        worker = self.workers[w]
        instance = worker.instance - 1 if stale else worker.instance
        self._deliver(w, worker.batch(self.sent[w], instance), must_fail=True)

    @rule(w=st.sampled_from(WORKERS))
    def worker_restarts(self, w: WorkerId) -> None:
        """A new instance with an empty cache; the old stream breaks, the router resubscribes."""
        self.workers[w] = Worker(instance=self.workers[w].instance + 1)
        self.sent[w] = []
        if w in self.followers:
            self._subscribe(w)

    @precondition(lambda self: self.followers)
    @rule(data=st.data())
    def router_drops_a_worker(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.followers)))
        del self.followers[w]
        self.index.drop_worker(w)
        assert self.index.num_blocks(w) == 0

    @rule(w=st.sampled_from(WORKERS))
    def router_adds_a_worker(self, w: WorkerId) -> None:
        if w not in self.followers:
            self._subscribe(w)

    @rule()
    def router_restarts(self) -> None:
        self.index = BlockIndex(max_blocks_per_worker=len(UNIVERSE))
        for w in list(self.followers):
            self._subscribe(w)

    @invariant()
    def the_index_equals_the_truth_of_every_in_step_worker(self) -> None:
        if not hasattr(self, "index"):
            return
        in_step = [w for w in self.followers if self.in_step[w] and not self.workers[w].unsent]
        for w in in_step:
            truth = self.workers[w].cached
            assert self.index.num_blocks(w) == len(truth)
            for h in UNIVERSE:
                held = self.index.match_prefix([BlockHash(h)], [w])[w]
                assert held == (h in truth), (w, h, truth)
        for w in set(WORKERS) - set(self.followers):
            assert self.index.num_blocks(w) == 0
        if len(in_step) == len(self.followers):
            union = set().union(*(self.workers[w].cached for w in self.followers))
            assert len(self.index) == len(union)


BlockIndexMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_index_follows_the_workers = BlockIndexMachine.TestCase


def test_a_worker_slot_reused_after_a_drop_carries_nothing_over() -> None:
    index = BlockIndex()
    index.add(WorkerId("a"), [BlockHash(1), BlockHash(2)])
    index.drop_worker(WorkerId("a"))
    index.add(WorkerId("b"), [BlockHash(2)])  # takes a's slot
    assert index.match_prefix([BlockHash(1), BlockHash(2)], [WorkerId("b")]) == {"b": 0}
    assert index.match_prefix([BlockHash(2)], [WorkerId("b")]) == {"b": 1}
    assert len(index) == 1


@pytest.mark.parametrize("bound", [1, 3])
def test_the_bound_keeps_a_workers_newest_blocks(bound: int) -> None:
    index = BlockIndex(max_blocks_per_worker=bound)
    index.add(WorkerId("a"), [BlockHash(h) for h in range(1, 6)])
    assert index.num_blocks(WorkerId("a")) == bound
    newest = [BlockHash(h) for h in range(6 - bound, 6)]
    assert index.match_prefix(newest, [WorkerId("a")]) == {"a": bound}
