"""What the engine thread publishes after each step, for readers on other threads: the
step's KV events fanned out to every subscriber, and the load snapshot ``Load`` answers from.

Both run on the engine thread right after the step that changed them, which is what makes a
snapshot plus the events after it exact. Split from ``engine_loop``: the loop decides when
to publish, this decides what a subscriber gets and how the load is counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow.engine_worker.core.block_pool import BlockPool
from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.loop_records import KvSnapshot, KvSubscription, LoadSnapshot

# A subscriber more than 4096 batches behind (tens of seconds of a busy worker) gets a
# fresh snapshot instead: cheaper than an unbounded queue, and exact.
MAX_PENDING_KV_BATCHES = 4096


def publish_kv_events(pool: BlockPool, subscribers: Iterable[KvSubscription]) -> None:
    """Hand each subscriber the events since the last step, or a snapshot where it asked
    for one or fell too far behind."""
    events = pool.events.drain()
    for sub in subscribers:
        if len(sub.pending) > MAX_PENDING_KV_BATCHES:
            sub.pending.clear()
            sub.needs_snapshot = True
        if sub.needs_snapshot:
            sub.needs_snapshot = False
            sub.push(KvSnapshot(pool.events.last_seq, pool.cached_hashes()))
        elif events:
            sub.push(events)


def load_snapshot(engine: Engine) -> LoadSnapshot:
    kv = engine.kv_cache
    num_prefill = num_decode = num_kv = 0
    for request in engine.requests.values():  # one pass over the open requests
        left = request.num_prompt_tokens - request.num_computed_tokens
        if left > 0:
            num_prefill += left
        else:
            num_decode += 1
            num_kv += request.num_computed_tokens
    return LoadSnapshot(
        num_waiting=engine.scheduler.num_waiting,
        num_running=engine.scheduler.num_running,
        kv_usage=kv.pool.usage,
        num_cached_blocks=kv.pool.num_cached_blocks,
        num_free_blocks=kv.pool.num_free_blocks,
        num_total_blocks=kv.num_total_blocks,
        prefix_hit_rate=kv.stats.hit_rate,
        num_kv_transfers=engine.scheduler.num_kv_transfers,
        num_prefill_tokens=num_prefill,
        num_decode_seqs=num_decode,
        num_kv_tokens=num_kv,
    )
