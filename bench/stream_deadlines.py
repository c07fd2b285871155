"""What watching a stream's deadlines costs per message (docs/benchmarks.md, "Router stream
deadlines"): `WorkerStream.next()` over a fake gRPC call that yields at once, without
deadlines, with the shipped one-timer-per-stream watch, and with an `asyncio.timeout`
around each read (the rejected design). In process, uvloop, three interleaved rounds.

    python bench/stream_deadlines.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import uvloop

from kvflow.proto import worker_pb2 as pb
from kvflow.router.workers.client import WorkerStream
from kvflow.router.workers.deadlines import StreamDeadlines

NUM_MESSAGES = 100_000
MESSAGE = pb.GenerateResponse(token_ids=[5])


class InstantCall:
    """A Generate call whose messages are all there already."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[pb.GenerateResponse]:
        for _ in range(NUM_MESSAGES):
            yield MESSAGE

    def cancel(self) -> None:
        pass


class NamedClient:
    address = "fake:1"


async def per_message_us(deadlines: StreamDeadlines | None, *, timeout_per_read: bool) -> float:
    stream = WorkerStream(NamedClient(), "r", InstantCall(), deadlines)  # type: ignore[arg-type]
    started = time.perf_counter()
    for _ in range(NUM_MESSAGES):
        if timeout_per_read:
            async with asyncio.timeout(30):
                await stream.next()
        else:
            await stream.next()
    elapsed_s = time.perf_counter() - started
    stream.cancel()
    return elapsed_s / NUM_MESSAGES * 1e6


async def main() -> None:
    for round_ in range(1, 4):
        plain = await per_message_us(None, timeout_per_read=False)
        watched = await per_message_us(StreamDeadlines(), timeout_per_read=False)
        per_read = await per_message_us(None, timeout_per_read=True)
        print(
            f"round {round_}: next() {plain:.2f} us; one timer per stream {watched:.2f} us "
            f"({watched - plain:+.2f}); asyncio.timeout per read {per_read:.2f} us "
            f"({per_read - plain:+.2f})"
        )


if __name__ == "__main__":
    uvloop.run(main())
