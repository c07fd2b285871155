"""The engine's PD states, pure: a decode side that reserves what it lacks and waits, a
prefill side that computes without sampling and holds its blocks until sent, and blocks that
enter the prefix cache only once their KV exists."""

from __future__ import annotations

import pytest
from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, RequestOutput
from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import FinishReason, KvBlockRange, RequestStatus
from kvflow.engine_worker.core.sampling_params import SamplingParams

BS = 4
VOCAB = 500


class RecordingRunner(FakeRunner):
    """Records (request id, first position, number of tokens) of every computed chunk."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        super().__init__(block_size=BS, vocab_size=VOCAB)
        self.chunks: list[tuple[str, int, int]] = []
        self.fail_on_step = fail_on_step

    def execute(self, output):  # type: ignore[no-untyped-def]
        if self.fail_on_step is not None and self.num_steps + 1 == self.fail_on_step:
            self.num_steps += 1
            raise RuntimeError("the step failed halfway (out of memory, say)")
        for s in output.scheduled:
            self.chunks.append((s.request.request_id, s.num_computed_tokens, s.num_new_tokens))
        return super().execute(output)


def make_engine(runner: RecordingRunner, *, num_blocks: int = 32) -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, block_size=BS
        ),
        num_kv_blocks=num_blocks,
        vocab_size=VOCAB,
        eos_token_ids=(3,),
        hash_seed=b"seed",
    )
    return Engine(config, runner)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def drain(e: Engine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(100):
        if not e.has_schedulable_work:
            return outs
        outs += e.step()
    raise AssertionError("the engine never went idle")


def stored(e: Engine) -> set[int]:
    return {h for ev in e.kv_cache.pool.events.drain() if ev.kind is KvEventKind.STORED
            for h in ev.block_hashes}  # fmt: skip


PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks; the decode side may receive 20


def test_a_failed_step_caches_nothing_and_a_later_request_recomputes() -> None:
    runner = RecordingRunner(fail_on_step=1)
    e = make_engine(runner)
    e.add_request("a", PROMPT, greedy(2))
    with pytest.raises(RuntimeError):
        e.step()
    assert e.kv_cache.pool.num_cached_blocks == 0 and not stored(e)
    e.abort_request("a")
    assert e.kv_cache.pool.num_free_blocks == 32
    e.add_request("b", PROMPT, greedy(2))
    drain(e)
    assert ("b", 0, 21) in runner.chunks  # no hit on KV that was never computed
    assert len(stored(e)) == 5


def test_decode_reserves_what_it_lacks_waits_then_continues_from_the_landed_blocks() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_request("d", PROMPT, greedy(3), wants_remote_kv=True)
    [reserved] = e.step()
    assert reserved.kv_reserved is not None and reserved.kv_reserved.first_token == 0
    assert reserved.kv_reserved.end_token == 20 and len(reserved.kv_reserved.block_ids) == 5
    assert not runner.chunks and not e.has_schedulable_work  # waits, unscheduled
    assert e.scheduler.num_kv_transfers == 1 and e.kv_cache.pool.num_free_blocks == 27
    assert e.kv_cache.pool.num_cached_blocks == 0  # nothing cached before it lands
    assert e.remote_kv_landed("d")
    assert e.kv_cache.pool.num_cached_blocks == 5
    outs = drain(e)
    assert runner.chunks[0] == ("d", 20, 1)  # only the last token is computed here
    final = outs[-1]
    assert final.finish_reason is FinishReason.LENGTH and final.num_output_tokens == 3
    assert final.num_remote_tokens == 20 and final.num_cached_tokens == 0
    assert e.kv_cache.pool.num_free_blocks == 32


def test_decode_counts_its_own_cache_and_asks_only_for_the_rest() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_request("warm", PROMPT[:9], greedy(1))  # caches blocks 0 and 1
    drain(e)
    e.add_request("d", PROMPT, greedy(1), wants_remote_kv=True)
    [reserved] = e.step()
    assert reserved.kv_reserved is not None
    assert (reserved.kv_reserved.first_token, reserved.kv_reserved.end_token) == (8, 20)
    assert len(reserved.kv_reserved.block_ids) == 3


def test_decode_that_lacks_nothing_says_so_and_computes_like_any_request() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_request("warm", PROMPT, greedy(1))
    drain(e)
    e.add_request("d", PROMPT, greedy(2), wants_remote_kv=True)
    outs = e.step()
    assert outs[0].kv_reserved == KvBlockRange(20, 20, ())
    assert ("d", 20, 1) in runner.chunks and outs[1].new_tokens


def test_a_failed_transfer_computes_the_reserved_part_locally_and_caches_only_then() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_request("d", PROMPT, greedy(1), wants_remote_kv=True)
    e.step()
    assert e.remote_kv_failed("d")
    assert e.kv_cache.pool.num_cached_blocks == 0
    final = drain(e)[-1]
    assert runner.chunks[0] == ("d", 0, 21) and final.num_remote_tokens == 0
    assert e.kv_cache.pool.num_cached_blocks == 5  # now computed here
    assert not e.remote_kv_landed("d")  # a late landing of a finished request is ignored


def test_aborting_a_request_that_waits_for_kv_frees_its_reservation() -> None:
    e = make_engine(RecordingRunner())
    e.add_request("d", PROMPT, greedy(1), wants_remote_kv=True)
    e.step()
    out = e.abort_request("d")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert e.kv_cache.pool.num_free_blocks == 32 and e.scheduler.num_kv_transfers == 0
    assert not e.remote_kv_landed("d")


def test_prefill_computes_without_sampling_and_holds_blocks_until_sent() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_prefill_request("p", PROMPT, first_token=8, end_token=20)
    outs = drain(e)
    assert [o.new_tokens for o in outs] == [[]]
    assert outs[0].kv_to_send is not None
    assert (outs[0].kv_to_send.first_token, outs[0].kv_to_send.end_token) == (8, 20)
    assert len(outs[0].kv_to_send.block_ids) == 3
    assert runner.chunks == [("p", 0, 20)]
    request = e.requests["p"]
    assert request.status is RequestStatus.SENDING_KV and e.kv_cache.pool.num_free_blocks == 27
    assert e.kv_cache.pool.num_cached_blocks == 5
    final = e.complete_kv_send("p", is_sent=True)
    assert final is not None and final.finish_reason is FinishReason.STOP
    assert e.kv_cache.pool.num_free_blocks == 32 and not e.requests


def test_prefill_with_every_block_cached_computes_nothing() -> None:
    runner = RecordingRunner()
    e = make_engine(runner)
    e.add_request("warm", PROMPT, greedy(1))
    drain(e)
    runner.chunks.clear()
    e.add_prefill_request("p", PROMPT, first_token=0, end_token=20)
    [out] = e.step()
    assert out.kv_to_send is not None and len(out.kv_to_send.block_ids) == 5
    assert not runner.chunks
    final = e.complete_kv_send("p", is_sent=False)
    assert final is not None and final.finish_reason is FinishReason.ABORT
    assert e.kv_cache.pool.num_free_blocks == 32


@pytest.mark.parametrize(("first", "end"), [(0, 21), (2, 20), (8, 8), (0, 22), (4, 6)])
def test_prefill_ranges_must_be_whole_blocks_short_of_the_last_token(first: int, end: int) -> None:
    e = make_engine(RecordingRunner())
    with pytest.raises(InvalidRequestError, match="multiples of the block size"):
        e.add_prefill_request("p", PROMPT, first_token=first, end_token=end)
