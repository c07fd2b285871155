"""A worker's calls cancelled by its channel closing (it left the pool: `WorkerPool.
set_addresses` closes a removed worker's channel) are worker faults, raised as WorkerError;
a cancellation of the calling task itself still propagates as CancelledError.

Over real gRPC, to a scripted worker: a closed channel's calls raise CancelledError in
grpc.aio, which is what the client has to tell apart from its own task's cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from testkit.fake_worker import FakeWorker, running_fake_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.router.breaker.machine import Outcome
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.workers.client import WorkerClient, cancelled_call_error
from kvflow.router.workers.errors import WorkerCallError, WorkerDownError, breaker_outcome
from kvflow.router.workers.records import GenerateInput, KvReservation, PrefillInput, WorkerContext

pytestmark = pytest.mark.integration

SAMPLING = SamplingOptions(max_tokens=8, temperature=0.0, top_p=None, top_k=0, min_p=0.0,
                           seed=None, stop_strings=(), stop_token_ids=(), n=1, logprobs=False,
                           top_logprobs=0, ignore_eos=False)  # fmt: skip
REQUEST = GenerateInput("r-c0-a0", [1, 2, 3], SAMPLING, WorkerContext("salt"))
# The worker holds its first token back this long: a read is pending when the channel closes.
FAR_FIRST_TOKEN_S = 5.0


async def _reading(client: WorkerClient, worker: FakeWorker) -> asyncio.Task[object]:
    """A task blocked reading a stream whose request the worker has (and holds back)."""
    num_requests = len(worker.requests)
    stream = client.generate(REQUEST)
    reading: asyncio.Task[object] = asyncio.create_task(stream.next())
    async with asyncio.timeout(5):
        while len(worker.requests) == num_requests:
            await asyncio.sleep(0.01)
    assert not reading.done()
    return reading


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_call_cancelled_beneath_its_caller_is_a_worker_fault() -> None:
    left = cancelled_call_error("w:1", is_channel_closed=True)
    assert isinstance(left, WorkerDownError) and "left the pool" in left.detail
    # Not closed: nothing this router does cancels a call under a reader; still a fault.
    assert isinstance(cancelled_call_error("w:1", is_channel_closed=False), WorkerCallError)
    assert breaker_outcome(left) is Outcome.ERROR


def test_a_stream_whose_channel_closes_mid_read_raises_worker_down() -> None:
    worker = FakeWorker(token_delay_s=FAR_FIRST_TOKEN_S)
    with running_fake_worker(worker) as address:

        async def scenario() -> None:
            client = WorkerClient(address)
            reading = await _reading(client, worker)
            await client.close()
            with pytest.raises(WorkerDownError, match="left the pool"):
                await asyncio.wait_for(reading, timeout=5)

        asyncio.run(scenario())


def test_cancelling_the_reader_still_cancels_it_even_as_the_channel_closes() -> None:
    worker = FakeWorker(token_delay_s=FAR_FIRST_TOKEN_S)
    with running_fake_worker(worker) as address:

        async def scenario() -> None:
            client = WorkerClient(address)
            reading = await _reading(client, worker)
            reading.cancel()  # the client left
            with pytest.raises(asyncio.CancelledError):
                await reading
            await _until(lambda: REQUEST.request_id in worker.cancelled)  # aborted there
            # Both at once (the client leaves as its worker is removed): still cancelled.
            reading = await _reading(client, worker)
            reading.cancel()
            await client.close()
            with pytest.raises(asyncio.CancelledError):
                await reading

        asyncio.run(scenario())


def test_a_unary_call_whose_channel_closes_raises_worker_down() -> None:
    worker = FakeWorker(prefill_script=["hang"])
    with running_fake_worker(worker) as address:

        async def scenario() -> None:
            client = WorkerClient(address)
            job = PrefillInput("r-c0-a0", [1, 2, 3], WorkerContext("salt"))
            wire = pb.KvReservation(transfer_id="t").SerializeToString()
            destination = KvReservation(0, 16, wire)
            prefill = asyncio.create_task(client.prefill(job, destination, timeout_s=30))
            await _until(lambda: bool(worker.prefill_requests))
            await client.close()
            with pytest.raises(WorkerDownError, match="left the pool"):
                await asyncio.wait_for(prefill, timeout=5)
            # A call started after the close fails at once, the same way.
            with pytest.raises(WorkerDownError, match="left the pool"):
                client.generate(REQUEST)

        asyncio.run(scenario())
