"""A stopping worker's drain (stopping.py): it returns once nothing is in flight, and no
later than its timeout however much still is."""

from __future__ import annotations

import asyncio
import time

from kvflow.engine_worker.stopping import drain


def test_the_drain_returns_once_the_last_request_has_finished() -> None:
    async def run() -> float:
        in_flight = [2]

        async def finish_later() -> None:
            await asyncio.sleep(0.2)
            in_flight[0] = 0

        task = asyncio.create_task(finish_later())
        start = time.monotonic()
        await drain(lambda: in_flight[0], timeout_s=30.0)
        await task
        return time.monotonic() - start

    assert 0.2 <= asyncio.run(run()) < 5.0


def test_the_drain_gives_up_at_its_timeout() -> None:
    start = time.monotonic()
    # Bounded here too: a drain that ignored its timeout fails this test, not hangs it.
    asyncio.run(asyncio.wait_for(drain(lambda: 1, timeout_s=0.3), timeout=5.0))
    assert 0.3 <= time.monotonic() - start < 5.0


def test_nothing_in_flight_returns_at_once() -> None:
    start = time.monotonic()
    asyncio.run(drain(lambda: 0, timeout_s=30.0))
    assert time.monotonic() - start < 1.0
