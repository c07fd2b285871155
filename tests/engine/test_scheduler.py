"""The token-budget scheduler: chunked prefill, decode batching, priority, preemption."""

from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.core.request import FinishReason, RequestStatus
from kvflow.engine_worker.core.sampling_params import SamplingParams

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 0.001
        return self.now_s


def engine(
    *, budget: int = 8, num_blocks: int = 64, max_seqs: int = 8, caching: bool = True
) -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256, block_size=BS
        ),
        num_kv_blocks=num_blocks,
        vocab_size=1000,
        eos_token_ids=(999,),
        hash_seed=b"s",
        enable_prefix_caching=caching,
    )
    return Engine(config, FakeRunner(block_size=BS, vocab_size=1000, eos_token_id=999), Clock())


def plan(e: Engine) -> list[tuple[str, int, int]]:
    out = e.scheduler.schedule(e.clock())
    e.scheduler.update_from_output(out)
    for s in out.scheduled:
        if s.samples:
            s.request.token_ids.append(7)
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_long_prompt_is_chunked_and_decodes_ride_along() -> None:
    e = engine(budget=8)
    e.add_request("a", list(range(3)), SamplingParams(max_tokens=10))
    e.add_request("b", list(range(100, 120)), SamplingParams(max_tokens=10))
    assert plan(e) == [("a", 0, 3), ("b", 0, 5)]
    assert plan(e) == [("a", 3, 1), ("b", 5, 7)]
    assert plan(e) == [("a", 4, 1), ("b", 12, 7)]
    assert plan(e) == [("a", 5, 1), ("b", 19, 1)]  # b's prompt ended at 20 and it sampled


def test_max_num_seqs_limits_admission() -> None:
    e = engine(budget=100, max_seqs=2)
    for rid in "abc":
        e.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=5))
    assert [r for r, _, _ in plan(e)] == ["a", "b"]
    assert e.scheduler.num_waiting == 1


def test_priority_then_arrival_order_for_admission() -> None:
    e = engine(budget=3, max_seqs=8)
    e.add_request("late-urgent", [1, 2, 3], SamplingParams(), priority=-1)
    e.add_request("normal-1", [4, 5, 6], SamplingParams())
    e.add_request("urgent", [7, 8, 9], SamplingParams(), priority=-1)
    assert [r for r, _, _ in plan(e)] == ["late-urgent"]
    e.scheduler.finish(e.requests["late-urgent"], FinishReason.ABORT)
    del e.requests["late-urgent"]
    assert [r for r, _, _ in plan(e)] == ["urgent"]


def test_preemption_frees_the_latest_request_and_recomputes_it() -> None:
    # 4 blocks of 4 tokens. a and b each hold 2 blocks after prefill; decoding needs more.
    e = engine(budget=64, num_blocks=4, caching=False)
    e.add_request("a", list(range(8)), SamplingParams(max_tokens=20, ignore_eos=True))
    e.add_request("b", list(range(10, 18)), SamplingParams(max_tokens=20, ignore_eos=True))
    assert plan(e) == [("a", 0, 8), ("b", 0, 8)]
    # Each has 9 tokens now, which needs a third block: only a fits, b is preempted.
    out = e.scheduler.schedule(e.clock())
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in out.preempted] == ["b"]
    b = e.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and e.kv_cache.block_ids("b") == []
    assert e.kv_cache.pool.num_free_blocks == 1


def test_engine_runs_to_completion_and_frees_everything() -> None:
    e = engine(budget=16, num_blocks=12)
    for i in range(6):
        e.add_request(f"r{i}", list(range(i, i + 9)), SamplingParams(max_tokens=7, ignore_eos=True))
    finished = {}
    steps = 0
    while e.has_unfinished_requests:
        for out in e.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out
        steps += 1
        assert steps < 200
    assert set(finished) == {f"r{i}" for i in range(6)}
    assert all(
        o.finish_reason is FinishReason.LENGTH and o.num_output_tokens == 7
        for o in finished.values()
    )
    assert e.kv_cache.pool.num_free_blocks == 12
    assert all(b.ref_cnt == 0 for b in e.kv_cache.pool.blocks)
