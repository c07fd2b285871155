"""Fair sharing across tenants and the bounded waiting queue, in the real engine (a fixed
token rule stands in for the model): one tenant's flood cannot starve another, priority is
a weight, and a full queue refuses at once holding nothing."""

from __future__ import annotations

import pytest
from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.core.errors import QueueFullError
from kvflow.engine_worker.core.fair_queue import FairWaitingQueue, priority_weight
from kvflow.engine_worker.core.queue_limits import DrainRateMeter, QueueStats, check_queue
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams

BS = 4
VOCAB = 1000


class Clock:
    """0.1 s per reading: a step reads it twice or so, which gives the drain meter time."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.1
        return self.now_s


def engine(*, max_seqs: int = 2, max_waiting: int | None = None,
           max_queue_time_s: float | None = None) -> Engine:  # fmt: skip
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=max_seqs,
            max_model_len=128,
            block_size=BS,
            max_waiting_requests=max_waiting,
            max_queue_time_s=max_queue_time_s,
        ),
        num_kv_blocks=256,
        vocab_size=VOCAB,
        eos_token_ids=(VOCAB - 1,),
        hash_seed=b"seed",
    )
    return Engine(config, FakeRunner(block_size=BS, vocab_size=VOCAB, eos_token_id=VOCAB - 1),
                  Clock())  # fmt: skip


def add(e: Engine, rid: str, tenant: str, *, priority: int = 0, max_tokens: int = 4) -> None:
    e.add_request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  cache_salt=tenant, priority=priority)  # fmt: skip


def admission_order(e: Engine, max_steps: int = 10_000) -> list[str]:
    """Request ids in the order they were first scheduled, running everything to the end."""
    order: list[str] = []
    for _ in range(max_steps):
        if not e.has_unfinished_requests:
            return order
        for request in e.scheduler.running:
            if request.request_id not in order:
                order.append(request.request_id)
        e.step()
    raise AssertionError("the engine did not finish")


def req(rid: str, tenant: str, arrival_s: float, priority: int = 0) -> Request:
    return Request(rid, [1], SamplingParams(), arrival_s, priority=priority, tenant=tenant)


def test_queue_alternates_between_backlogged_tenants_by_tokens_served() -> None:
    q = FairWaitingQueue()
    for i in range(4):
        q.push(req(f"a{i}", "A", i))
    q.push(req("b0", "B", 10))
    q.push(req("b1", "B", 11))
    popped = []
    while q:
        r = q.pop()
        popped.append(r.request_id)
        q.charge(r, 8)  # every admission costs its tenant 8 tokens
    # Ties go to the earlier head; then whoever has been served less.
    assert popped == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert len(q) == 0 and q.num_tenants == 0


def test_a_tenant_that_was_idle_starts_level_not_with_banked_credit() -> None:
    q = FairWaitingQueue()
    for i in range(3):
        q.push(req(f"a{i}", "A", i))
    for _ in range(3):
        q.charge(q.pop(), 100)  # A served 300 tokens while B was away
    q.push(req("a3", "A", 3))
    q.push(req("a4", "A", 4))
    q.push(req("b0", "B", 5))
    q.push(req("b1", "B", 6))
    assert q.served_tokens("B") == q.served_tokens("A") == 300
    popped = []
    while q:
        r = q.pop()
        popped.append(r.request_id)
        q.charge(r, 10)
    assert popped == ["a3", "b0", "a4", "b1"]  # alternating, not b0, b1 first


def test_priority_is_a_weight_across_tenants_and_a_rank_within_one() -> None:
    assert priority_weight(0) == 1.0 and priority_weight(-1) == 2.0 and priority_weight(2) == 0.25
    q = FairWaitingQueue()
    for i in range(9):
        q.push(req(f"u{i}", "urgent", i, priority=-1))
        q.push(req(f"n{i}", "normal", i, priority=0))
    popped = []
    for _ in range(9):
        r = q.pop()
        popped.append(r.request_id)
        q.charge(r, 10)
    # Twice the share, not all of it: 6 urgent and 3 normal in 9.
    assert sum(r.startswith("u") for r in popped) == 6
    # Within one tenant, the more urgent request goes first whatever its arrival.
    q.push(req("n-late-urgent", "normal", 100, priority=-3))
    while q.peek().tenant == "urgent":
        q.charge(q.pop(), 10)
    assert q.pop().request_id == "n-late-urgent"


def test_remove_and_len_stay_consistent() -> None:
    q = FairWaitingQueue()
    a, b = req("a", "A", 0), req("b", "B", 1)
    q.push(a)
    q.push(b)
    q.remove(a)
    q.remove(a)  # not there any more: a no-op
    assert len(q) == 1 and list(q) == [b] and q.peek() is b


def test_a_flooding_tenant_does_not_starve_another_in_the_engine() -> None:
    e = engine(max_seqs=2)
    for i in range(40):
        add(e, f"a{i}", "tenant-a", max_tokens=4)
    e.step()  # a0 and a1 run
    add(e, "b0", "tenant-b", max_tokens=4)
    add(e, "b1", "tenant-b", max_tokens=4)
    order = admission_order(e)
    # First come first served would put b0 42nd; fair sharing admits it with the next
    # free slot, and b1 right after one more of A's.
    assert order.index("b0") <= 3 and order.index("b1") <= 5
    assert e.kv_cache.pool.num_free_blocks == 256


def test_full_queue_refuses_at_once_and_holds_nothing() -> None:
    e = engine(max_seqs=1, max_waiting=3)
    for i in range(4):  # one runs after a step, three wait
        add(e, f"r{i}", "t", max_tokens=50)
        if i == 0:
            e.step()
    free_before = e.kv_cache.pool.num_free_blocks
    with pytest.raises(QueueFullError) as info:
        add(e, "over", "t")
    assert "queue is full (3 requests waiting, --max-waiting-requests 3)" in str(info.value)
    assert 1.0 <= info.value.retry_after_s <= 60.0
    assert "over" not in e.requests and e.kv_cache.pool.num_free_blocks == free_before
    e.abort_request("r1")  # room again
    add(e, "again", "t")
    assert "again" in e.requests


def test_queue_time_bound_uses_the_measured_drain_rate() -> None:
    e = engine(max_seqs=1, max_queue_time_s=2.0)
    for i in range(3):
        add(e, f"r{i}", "t", max_tokens=3)
    for _ in range(12):  # r0..r2 run in turn: the queue drains about 1 per 3-4 steps
        e.step()
    assert e.queue_stats.drain_rate_per_s > 0
    for i in range(3, 20):
        try:
            add(e, f"r{i}", "t", max_tokens=3)
        except QueueFullError as exc:
            assert "estimated" not in str(exc) and "would hold the request" in str(exc)
            break
    else:
        raise AssertionError("the queue-time bound never refused")
    stats = e.queue_stats
    wait_s = stats.estimated_wait_s(stats.num_waiting + 1)
    assert wait_s is not None and wait_s > 2.0


def test_drain_meter_ignores_steps_that_were_not_backlogged() -> None:
    meter = DrainRateMeter(time_constant_s=5.0)
    meter.observe(10, 1.0, was_backlogged=False)
    assert meter.rate_per_s == 0.0
    meter.observe(2, 1.0, was_backlogged=True)
    meter.observe(2, 1.0, was_backlogged=True)
    assert meter.rate_per_s == pytest.approx(2.0)
    assert QueueStats(4, 2.0, 8).estimated_wait_s() == pytest.approx(2.0)
    assert QueueStats(4, 0.0, 8).estimated_wait_s() is None
    check_queue(QueueStats(7, 0.0, 8), max_queue_time_s=0.001)  # rate unknown: count only


def test_a_refusal_names_the_bound_that_refused_it() -> None:
    with pytest.raises(QueueFullError) as full:
        check_queue(QueueStats(8, 2.0, 8), max_queue_time_s=None)
    assert full.value.reason == "queue_full"
    with pytest.raises(QueueFullError) as slow:  # 5 waiting at 2/s: 3 s > 1 s
        check_queue(QueueStats(4, 2.0, 8), max_queue_time_s=1.0)
    assert slow.value.reason == "queue_time"
