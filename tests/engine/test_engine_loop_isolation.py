"""One request's trouble stays that request's: a duplicate id is refused without touching
the request that holds it, a stream that leaves aborts only its own request, and an
exception while serving one request (handoff code, a logits processor) fails that request
alone while the engine thread serves every other one on.

Real engine loops with real KV transfer agents over TCP on loopback; the simulated runner
stands in for the model (its blocks are real bytes moved by the real transport)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, RequestOutput
from kvflow.engine_worker.core.errors import DuplicateRequestError, RequestFailedError
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.engine_worker.loop_records import KvReservationOut, PrefillResult
from kvflow.engine_worker.sim_runner import SimulatedRunner

BS = 16
NUM_BLOCKS = 64
PROMPT = list(range(10, 60))  # 50 tokens: 3 full blocks to ship


def make_loop(instance: str) -> EngineLoop:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512, block_size=BS
        ),
        num_kv_blocks=NUM_BLOCKS,
        vocab_size=1000,
        eos_token_ids=(999,),
        hash_seed=b"s",
    )
    runner = SimulatedRunner(
        vocab_size=1000, eos_token_ids=(999,), kv_bytes_per_block=256, block_size=BS
    )
    transport = TcpTransport("127.0.0.1", 0, "127.0.0.1", token="t0ken")
    agent = KvTransferAgent(transport, instance_id=instance, max_timeout_s=10.0)
    loop = EngineLoop(Engine(config, runner), kv=agent, blocks=runner)
    loop.start()
    return loop


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def tokens_of(stream: AsyncIterator[object]) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        if isinstance(out, RequestOutput):
            tokens += [t.token_id for t in out.new_tokens]
    return tokens


async def disaggregated(
    decode: EngineLoop, prefill: EngineLoop, rid: str, n: int = 4
) -> tuple[list[int], PrefillResult | BaseException]:
    # Each request in a cache namespace of its own: decode lacks its prompt.
    stream = decode.generate(rid, PROMPT, greedy(n), cache_salt=rid, remote_kv_timeout_s=10.0)
    first = await anext(stream)
    assert isinstance(first, KvReservationOut) and first.ticket is not None
    t = first.ticket
    target = SendTarget(t.transfer_id, t.endpoint, t.tag, "decode")
    sent: PrefillResult | BaseException
    try:
        sent = await prefill.prefill(
            rid, PROMPT, target, first_token=first.first_token, end_token=first.end_token,
            timeout_s=10.0, cache_salt=rid,
        )  # fmt: skip
    except Exception as exc:
        sent = exc
    return await tokens_of(stream), sent


async def wait_idle(*loops: EngineLoop) -> None:
    for _ in range(400):
        if all(
            not lp.engine.requests
            and lp.engine.kv_cache.pool.usage == 0.0
            and lp.num_in_flight == 0
            and (lp.kv is None or lp.kv.num_active == 0)
            for lp in loops
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("a loop still holds work")


def stop(*loops: EngineLoop) -> None:
    for lp in loops:
        lp.stop()
        assert lp.kv is not None
        lp.kv.close()


def test_a_duplicate_prefill_is_refused_and_the_original_completes() -> None:
    """The duplicate arrives while the original is queued: its target must not replace
    (nor its refusal delete) the original's, which then sends to its own decode worker."""

    async def main() -> None:
        decode, prefill = make_loop("decode-1"), make_loop("prefill-1")
        try:
            stream = decode.generate("x", PROMPT, greedy(4), remote_kv_timeout_s=10.0)
            first = await anext(stream)
            assert isinstance(first, KvReservationOut) and first.ticket is not None
            t = first.ticket
            target = SendTarget(t.transfer_id, t.endpoint, t.tag, "decode")
            elsewhere = SendTarget("nobody-1", "127.0.0.1:9", 1, "other")
            kw = {"first_token": first.first_token, "end_token": first.end_token}
            # Both commands land in one batch of the engine thread: the original is
            # admitted, then the duplicate is refused before its first step.
            original = asyncio.ensure_future(
                prefill.prefill("x", PROMPT, target, timeout_s=10, **kw)
            )
            duplicate = asyncio.ensure_future(
                prefill.prefill("x", PROMPT, elsewhere, timeout_s=10, **kw)
            )
            with pytest.raises(DuplicateRequestError, match="already running"):
                await duplicate
            result = await original
            assert result.num_sent_blocks == 3
            assert len(await tokens_of(stream)) == 4
            await wait_idle(decode, prefill)
            # The prefill worker serves on, and so does decode.
            tokens, sent = await disaggregated(decode, prefill, "after")
            assert len(tokens) == 4 and isinstance(sent, PrefillResult)
            assert prefill.heartbeat.problem() is None
        finally:
            stop(decode, prefill)

    asyncio.run(main())


def test_a_duplicate_decode_stream_that_leaves_does_not_abort_the_original() -> None:
    async def main() -> None:
        decode, prefill = make_loop("decode-2"), make_loop("prefill-2")
        try:
            stream = decode.generate("y", PROMPT, greedy(4), remote_kv_timeout_s=10.0)
            first = await anext(stream)
            assert isinstance(first, KvReservationOut) and first.ticket is not None
            # A second stream under the same id, whose caller goes away at once.
            second = decode.generate("y", PROMPT, greedy(4), remote_kv_timeout_s=10.0)
            pending = asyncio.ensure_future(anext(second))
            await asyncio.sleep(0)
            pending.cancel()
            with pytest.raises((asyncio.CancelledError, DuplicateRequestError)):
                await pending
            await second.aclose()
            await asyncio.sleep(0.05)  # the engine thread ran whatever it posted
            assert "y" in decode.engine.requests
            t = first.ticket
            target = SendTarget(t.transfer_id, t.endpoint, t.tag, "decode")
            await prefill.prefill("y", PROMPT, target, first_token=first.first_token,
                                  end_token=first.end_token, timeout_s=10)  # fmt: skip
            assert len(await tokens_of(stream)) == 4
            await wait_idle(decode, prefill)
        finally:
            stop(decode, prefill)

    asyncio.run(main())


def test_an_exception_in_one_handoff_fails_that_request_and_the_others_are_served() -> None:
    async def main() -> None:
        decode, prefill = make_loop("decode-3"), make_loop("prefill-3")
        assert prefill.handoff is not None
        real = prefill.handoff.on_kv_ready

        def broken(request_id: str, kv_range: object) -> None:
            if request_id == "boom":
                raise KeyError(request_id)  # as a lost send target once did
            real(request_id, kv_range)  # type: ignore[arg-type]

        prefill.handoff.on_kv_ready = broken  # type: ignore[method-assign]
        try:
            runs = await asyncio.gather(
                *(disaggregated(decode, prefill, rid) for rid in ("a", "boom", "b", "c"))
            )
            by_id = dict(zip(("a", "boom", "b", "c"), runs, strict=True))
            failed = by_id.pop("boom")[1]
            assert isinstance(failed, RequestFailedError) and "KeyError" in str(failed)
            for tokens, sent in by_id.values():
                assert len(tokens) == 4 and isinstance(sent, PrefillResult)
            # The failed one's decode side computed its prompt itself once the KV did not
            # come; nothing leaks on either side and both engine threads still serve.
            await wait_idle(decode, prefill)
            assert prefill.heartbeat.problem() is None
            tokens, sent = await disaggregated(decode, prefill, "later")
            assert len(tokens) == 4 and isinstance(sent, PrefillResult)
        finally:
            stop(decode, prefill)

    asyncio.run(main())


class Raises:
    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        raise RuntimeError("the grammar broke")


def test_a_failing_logits_processor_fails_only_its_request() -> None:
    """A real model (the tiny Llama) samples through the processor; the request whose
    processor raises fails, the batch it shared a step with finishes normally."""
    from testkit.tiny_model import write_tiny_llama

    from kvflow.engine_worker.app import build_worker
    from kvflow.engine_worker.settings import WorkerSettings

    async def main(model_dir: str) -> None:
        built = build_worker(WorkerSettings(model=model_dir, num_kv_blocks=64, max_model_len=256))
        loop = EngineLoop(built.engine)
        loop.start()
        try:

            async def run(rid: str, processor: Raises | None) -> list[int] | BaseException:
                sampling = SamplingParams(
                    temperature=0.0, max_tokens=6, ignore_eos=True, logits_processor=processor
                )
                try:
                    return await tokens_of(loop.generate(rid, PROMPT[:20], sampling))
                except Exception as exc:
                    return exc

            results = await asyncio.gather(
                run("ok-1", None), run("bad", Raises()), run("ok-2", None)
            )
            assert results[0] == results[2] and len(results[0]) == 6  # type: ignore[arg-type]
            assert isinstance(results[1], RequestFailedError) and "grammar" in str(results[1])
            assert not loop.engine.requests and loop.heartbeat.problem() is None
            assert len(await run("after", None)) == 6  # type: ignore[arg-type]
        finally:
            loop.stop()
            built.close()

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(str(write_tiny_llama(Path(tmp) / "tiny", seed=3))))


def test_a_failing_step_observer_does_not_end_the_engine_thread() -> None:
    """Metrics run on the engine thread after every step; their bug costs a data point."""
    calls = {"n": 0}

    def observe(engine: Engine, outputs: list[RequestOutput], now_s: float) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("a metric broke")

    async def main() -> None:
        loop = make_loop("solo")
        loop.on_step = observe
        try:
            for rid in ("a", "b"):
                assert len(await tokens_of(loop.generate(rid, PROMPT, greedy(4)))) == 4
            assert calls["n"] > 2 and loop.heartbeat.problem() is None
        finally:
            stop(loop)

    asyncio.run(main())
