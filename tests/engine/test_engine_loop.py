"""The engine thread driven from asyncio: streams, aborts, and KV event fan-out."""

from __future__ import annotations

import asyncio

import pytest
from testkit.fake_runner import FakeRunner

from kvflow.engine_worker import loop_publish
from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.core.errors import EngineOverloadedError, InvalidRequestError
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.loop_records import KvSnapshot

BS = 4


def make_loop(num_blocks: int = 64) -> EngineLoop:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, block_size=BS
        ),
        num_kv_blocks=num_blocks,
        vocab_size=1000,
        eos_token_ids=(999,),
        hash_seed=b"s",
    )
    loop = EngineLoop(Engine(config, FakeRunner(block_size=BS, vocab_size=1000, eos_token_id=999)))
    loop.start()
    return loop


async def collect(loop: EngineLoop, rid: str, prompt: list[int], n: int) -> list[int]:
    tokens: list[int] = []
    async for out in loop.generate(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        tokens += [t.token_id for t in out.new_tokens]
    return tokens


def test_concurrent_streams_and_errors() -> None:
    async def main() -> None:
        loop = make_loop()
        try:
            results = await asyncio.gather(
                *(collect(loop, f"r{i}", [i + 1] * (5 + i), 6) for i in range(5))
            )
            assert [len(r) for r in results] == [6] * 5
            with pytest.raises(InvalidRequestError, match="empty"):
                await collect(loop, "bad", [], 3)
            assert loop.num_in_flight == 0
        finally:
            loop.stop()

    asyncio.run(main())


def test_leaving_a_stream_early_aborts_the_request() -> None:
    async def main() -> None:
        loop = make_loop()
        try:
            stream = loop.generate(
                "long", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)
            )
            await anext(stream)
            await stream.aclose()
            for _ in range(200):
                if not loop.engine.has_unfinished_requests:
                    break
                await asyncio.sleep(0.01)
            assert not loop.engine.has_unfinished_requests
            assert loop.engine.kv_cache.pool.num_free_blocks == 64
        finally:
            loop.stop()

    asyncio.run(main())


def test_draining_refuses_new_requests() -> None:
    async def main() -> None:
        loop = make_loop()
        loop.is_draining = True
        try:
            with pytest.raises(EngineOverloadedError, match="shutting down"):
                await collect(loop, "late", [1], 1)
        finally:
            loop.stop()

    asyncio.run(main())


def test_subscriber_gets_snapshot_then_exact_events() -> None:
    async def main() -> None:
        loop = make_loop()
        try:
            await collect(loop, "warm", list(range(8)), 1)
            sub = loop.subscribe()
            snap = await asyncio.wait_for(sub.next(), 5)
            assert isinstance(snap, KvSnapshot)
            assert len(snap.block_hashes) == 2 and snap.seq == 1
            await collect(loop, "next", list(range(100, 112)), 1)
            batch = await asyncio.wait_for(sub.next(), 5)
            assert not isinstance(batch, KvSnapshot)
            assert [(e.seq, e.kind) for e in batch] == [(2, KvEventKind.STORED)]
            assert len(batch[0].block_hashes) == 3
        finally:
            loop.stop()

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_gets_a_fresh_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(loop_publish, "MAX_PENDING_KV_BATCHES", 3)

    async def main() -> None:
        loop = make_loop(num_blocks=256)
        try:
            sub = loop.subscribe()
            first = await asyncio.wait_for(sub.next(), 5)
            assert isinstance(first, KvSnapshot) and first.block_hashes == []
            for i in range(10):  # 10 steps with new blocks while nobody reads
                await collect(loop, f"r{i}", [500 + i] * 8, 1)
            pool = loop.engine.kv_cache.pool
            items = []
            last_seq = -1
            while last_seq < pool.events.last_seq:  # the last step publishes after its outputs
                item = await asyncio.wait_for(sub.next(), 5)
                items.append(item)
                last_seq = item.seq if isinstance(item, KvSnapshot) else item[-1].seq
            assert isinstance(items[0], KvSnapshot), "the backlog was replaced by a snapshot"
            snapshot = items[0]
            after = [e for item in items[1:] for e in item]  # type: ignore[union-attr]
            assert all(e.seq > snapshot.seq for e in after)
            known = set(snapshot.block_hashes)
            for e in after:
                if e.kind is KvEventKind.STORED:
                    known |= set(e.block_hashes)
                else:
                    known -= set(e.block_hashes)
            assert known == set(pool.cached_hashes())
        finally:
            loop.stop()

    asyncio.run(main())


def test_a_failing_step_aborts_in_flight_requests_and_keeps_serving() -> None:
    async def main() -> None:
        loop = make_loop()
        runner = loop.engine.runner
        real_execute = runner.execute
        calls = {"n": 0}

        def flaky(output):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated device failure")
            return real_execute(output)

        runner.execute = flaky  # type: ignore[method-assign]
        try:
            outs = [
                o
                async for o in loop.generate(
                    "victim", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True)
                )
            ]
            assert outs[-1].finish_reason is FinishReason.ABORT
            assert loop.engine.kv_cache.pool.num_free_blocks == 64
            assert len(await collect(loop, "after", [3, 4], 3)) == 3
        finally:
            loop.stop()

    asyncio.run(main())


def test_the_load_report_counts_prompt_tokens_to_prefill_and_decoding_kv() -> None:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, block_size=BS
        ),
        num_kv_blocks=64,
        vocab_size=1000,
        eos_token_ids=(999,),
        hash_seed=b"s",
    )
    engine = Engine(config, FakeRunner(block_size=BS, vocab_size=1000, eos_token_id=999))
    loop = EngineLoop(engine)  # not started: the load is computed on this thread
    engine.add_request("a", [1] * 30, SamplingParams(max_tokens=5, ignore_eos=True))
    loop._update_load()
    assert (loop.load.num_prefill_tokens, loop.load.num_decode_seqs) == (30, 0)
    engine.step()  # the whole prompt in one step: the request decodes from now on
    loop._update_load()
    assert (loop.load.num_prefill_tokens, loop.load.num_decode_seqs) == (0, 1)
    assert loop.load.num_kv_tokens == 30
