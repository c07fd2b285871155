"""Priority classes in the engine core (a fixed token rule stands in for the model): the
waiting queue and the step's budget go class by class, a waiting realtime request preempts
a running batch one when blocks or seats run out (never one of its own class), the victim
recomputes and finishes with the tokens it would have had, and preemptions are counted by
the victim's class."""

from __future__ import annotations

import random

import pytest
from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, RequestOutput
from kvflow.engine_worker.core.errors import QueueFullError
from kvflow.engine_worker.core.fair_queue import FairWaitingQueue
from kvflow.engine_worker.core.request import FinishReason, Request, RequestStatus
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.proto.priority_class import PriorityClass

BS = 4
VOCAB = 1000
RT, NORMAL, BATCH = PriorityClass.REALTIME, PriorityClass.NORMAL, PriorityClass.BATCH


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


def engine(*, budget: int = 64, num_blocks: int = 64, max_seqs: int = 8) -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256, block_size=BS
        ),
        num_kv_blocks=num_blocks,
        vocab_size=VOCAB,
        eos_token_ids=(VOCAB - 1,),
        hash_seed=b"s",
        enable_prefix_caching=False,
    )
    runner = FakeRunner(block_size=BS, vocab_size=VOCAB, eos_token_id=VOCAB - 1)
    return Engine(config, runner, Clock())


def add(e: Engine, rid: str, cls: PriorityClass, prompt: list[int], max_tokens: int = 4,
        tenant: str = "t") -> None:  # fmt: skip
    e.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  tenant=tenant, priority_class=cls)  # fmt: skip


def run_to_end(
    e: Engine, max_steps: int = 1000
) -> tuple[dict[str, RequestOutput], dict[str, list[int]]]:
    """Each request's final output and every token it streamed."""
    tokens: dict[str, list[int]] = {}
    finished: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not e.has_unfinished_requests:
            return finished, tokens
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
            if out.finish_reason is not None:
                finished[out.request_id] = out
    raise AssertionError("the engine did not finish")


def request(rid: str, tenant: str, cls: PriorityClass, arrival_s: float) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), arrival_s, tenant=tenant, priority_class=cls)


def test_queue_admits_class_by_class_and_fairly_within_a_class() -> None:
    q = FairWaitingQueue()
    q.charge(request("x", "heavy", NORMAL, 0.0), 1000)  # heavy has been served a lot
    q.push(request("b1", "light", BATCH, 0.0))
    q.push(request("n1", "light", NORMAL, 1.0))
    q.push(request("r-heavy", "heavy", RT, 2.0))
    q.push(request("r-light", "light", RT, 3.0))
    q.push(request("n-heavy", "heavy", NORMAL, 4.0))
    # Realtime first whatever the arrival; within realtime the less served tenant first
    # even though it arrived later; then normal (fair again), then batch.
    assert [q.pop().request_id for _ in range(len(q))] == [
        "r-light", "r-heavy", "n1", "n-heavy", "b1",
    ]  # fmt: skip


def test_step_budget_goes_to_the_running_realtime_request_first() -> None:
    e = engine(budget=8)
    add(e, "batch", BATCH, list(range(20)), max_tokens=2)  # admitted first, a long prefill
    e.step()  # batch takes the whole budget: 8 of its 20 prompt tokens
    add(e, "rt", RT, list(range(100, 104)), max_tokens=2)
    out = e.scheduler.schedule(e.clock())
    # Without classes the running batch request would keep the budget (admission order).
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("rt", 4), ("batch", 4),
    ]  # fmt: skip


def test_realtime_preempts_a_running_batch_request_which_then_recomputes_correctly() -> None:
    prompt_b = list(range(10, 26))  # 16 tokens: 4 blocks, 5 once it decodes
    alone = engine(num_blocks=8)
    add(alone, "b", BATCH, prompt_b, max_tokens=6)
    _, undisturbed = run_to_end(alone)

    e = engine(num_blocks=8)  # 8 blocks of 4 tokens
    add(e, "b", BATCH, prompt_b, max_tokens=6)
    first = [t.token_id for _ in range(2) for o in e.step() for t in o.new_tokens]
    assert len(e.kv_cache.block_ids("b")) == 5  # b is decoding; 3 blocks are free
    add(e, "rt", RT, list(range(200, 216)), max_tokens=3)  # needs 4 blocks (5 to decode)
    e.step()
    b = e.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert e.requests["rt"].status is RequestStatus.RUNNING
    assert e.requests["rt"].first_token_time_s is not None  # its prefill ran at once
    assert e.scheduler.preemptions_by_class == {RT: 0, NORMAL: 0, BATCH: 1}

    finished, tokens = run_to_end(e)
    assert finished["rt"].finish_reason is FinishReason.LENGTH
    out_b = finished["b"]
    assert out_b.finish_reason is FinishReason.LENGTH and out_b.num_output_tokens == 6
    assert out_b.timings is not None and out_b.timings.num_preemptions == 1
    # Recomputed from its prompt and the tokens it had, it goes on as if undisturbed.
    assert first + tokens["b"] == undisturbed["b"]
    assert e.kv_cache.pool.num_free_blocks == 8


def test_a_waiting_request_never_preempts_its_own_class() -> None:
    e = engine(num_blocks=8)
    add(e, "n1", NORMAL, list(range(10, 26)), max_tokens=6)
    e.step()
    e.step()
    add(e, "n2", NORMAL, list(range(200, 216)), max_tokens=3)
    out = e.scheduler.schedule(e.clock())
    assert out.preempted == [] and [s.request.request_id for s in out.scheduled] == ["n1"]
    assert e.requests["n2"].status is RequestStatus.WAITING


def test_running_victim_is_the_least_urgent_class_even_when_it_came_first() -> None:
    # Both decode and outgrow the cache; the old rule took the latest request (rt).
    e = engine(num_blocks=4)
    add(e, "b", BATCH, list(range(8)), max_tokens=20)
    add(e, "rt", RT, list(range(10, 18)), max_tokens=20)
    e.step()
    out = e.scheduler.schedule(e.clock())
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["rt"]
    assert e.scheduler.preemptions_by_class[BATCH] == 1


def test_realtime_takes_a_seat_from_batch_when_every_seat_is_taken() -> None:
    e = engine(max_seqs=2)
    add(e, "b1", BATCH, [1, 2, 3], max_tokens=50)
    add(e, "b2", BATCH, [4, 5, 6], max_tokens=50)
    e.step()
    add(e, "n", NORMAL, [7, 8, 9], max_tokens=2)
    out = e.scheduler.schedule(e.clock())
    assert [r.request_id for r in out.preempted] == ["b2"]  # the later of the two
    assert {s.request.request_id for s in out.scheduled} == {"b1", "n"}
    assert len(e.scheduler.running) == 2


def test_the_queue_bound_counts_the_requests_ahead_of_a_class() -> None:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=256,
                                  block_size=BS, max_waiting_requests=2),
        num_kv_blocks=64, vocab_size=VOCAB, eos_token_ids=(VOCAB - 1,), hash_seed=b"s",
    )  # fmt: skip
    e = Engine(config, FakeRunner(block_size=BS, vocab_size=VOCAB), Clock())
    for i in range(3):  # one runs, two wait: the queue is at its bound for batch
        add(e, f"b{i}", BATCH, [1, 2, 3], max_tokens=50)
        e.step()
    with pytest.raises(QueueFullError, match=r"\(2 requests waiting, --max-waiting-requests 2\)"):
        add(e, "b3", BATCH, [1, 2, 3])
    # Normal and realtime requests are admitted before every waiting batch one: not full.
    add(e, "n0", NORMAL, [1, 2, 3])
    add(e, "n1", NORMAL, [1, 2, 3])
    with pytest.raises(QueueFullError):  # two normal ahead now
        add(e, "n2", NORMAL, [1, 2, 3])
    add(e, "r0", RT, [1, 2, 3])
    assert e.scheduler.waiting.num_waiting_by_rank == (1, 2, 2)
    assert e.queue_stats.num_waiting == 5


@pytest.mark.parametrize("seed", range(20))
def test_random_mixes_keep_the_invariants(seed: int) -> None:
    """Random arrivals of every class into a small cache with few seats: a step never both
    preempts and schedules a request, never preempts a request while scheduling a less
    urgent one, every request finishes with all its tokens, and every block comes back."""
    rng = random.Random(seed)
    e = engine(budget=16, num_blocks=24, max_seqs=4)
    wanted: dict[str, int] = {}
    for step in range(3000):
        if step < 60 and rng.random() < 0.4:
            rid = f"r{step}"
            wanted[rid] = rng.randint(1, 12)
            prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 20))]
            add(e, rid, rng.choice(list(PriorityClass)), prompt, max_tokens=wanted[rid],
                tenant=rng.choice("ab"))  # fmt: skip
        out = e.scheduler.schedule(e.clock())
        scheduled = [s.request for s in out.scheduled]
        assert not set(map(id, scheduled)) & set(map(id, out.preempted))
        if out.preempted and scheduled:
            least_urgent_served = max(r.priority_class.rank for r in scheduled)
            assert min(p.priority_class.rank for p in out.preempted) >= least_urgent_served
        e.runner.execute(out)
        e.scheduler.update_from_output(out)
        for s in out.scheduled:
            if s.samples:
                s.request.token_ids.append(7)
                if s.request.num_output_tokens >= wanted[s.request.request_id]:
                    e.scheduler.finish(s.request, FinishReason.LENGTH)
                    del e.requests[s.request.request_id]
        if step >= 60 and not e.requests:
            break
    assert not e.requests, "some requests never finished"
    assert e.kv_cache.pool.num_free_blocks == 24
