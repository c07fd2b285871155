"""Drive one load point: open loop on a fixed schedule, or closed loop with N users.

Open loop renders each request's body while waiting for its time, then starts it as its
own task at that time, never waiting for earlier requests: a server that slows down gets
the same arrivals and its queueing shows in the latencies. How late each send really was
(the schedule lag) is recorded per request, so a load generator that could not keep up
is visible in the results instead of quietly lowering the load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

from kvflow.loadgen.client import BenchClient, Clock
from kvflow.loadgen.payloads import encode_body
from kvflow.loadgen.progress import Progress
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest


def start_clock() -> Clock:
    t0_s = time.perf_counter()
    return lambda: time.perf_counter() - t0_s


async def _send_counted(
    client: BenchClient,
    request: BenchRequest,
    body: bytes,
    scheduled_s: float | None,
    now: Clock,
    progress: Progress,
) -> RequestRecord:
    record = await client.send(request.request_id, body, scheduled_s=scheduled_s, now=now)
    progress.num_done += 1
    progress.num_errors += record.error is not None
    return record


async def run_open_loop(
    client: BenchClient,
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    progress: Progress,
) -> list[RequestRecord]:
    """Send ``requests[i]`` at ``offsets_s[i]`` seconds from now; every record, in order."""
    assert len(requests) == len(offsets_s)
    now = start_clock()
    printer = asyncio.create_task(progress.show_every_interval(now))
    tasks = []
    try:
        for request, offset_s in zip(requests, offsets_s, strict=True):
            body = encode_body(client.config, request)
            delay_s = offset_s - now()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(
                asyncio.create_task(_send_counted(client, request, body, offset_s, now, progress))
            )
            progress.num_sent += 1
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        printer.cancel()
        progress.finish(now())


async def run_closed_loop(
    client: BenchClient,
    requests: Iterator[BenchRequest],
    num_users: int,
    stop_after_s: float,
    progress: Progress,
) -> list[RequestRecord]:
    """``num_users`` users each send the next request of the shared sequence as soon as
    their previous one ends, until ``stop_after_s`` or the sequence runs out."""
    now = start_clock()
    records: list[RequestRecord] = []

    async def user() -> None:
        while now() < stop_after_s:
            request = next(requests, None)
            if request is None:
                return
            body = encode_body(client.config, request)
            progress.num_sent += 1
            records.append(await _send_counted(client, request, body, None, now, progress))

    printer = asyncio.create_task(progress.show_every_interval(now))
    try:
        await asyncio.gather(*(user() for _ in range(num_users)))
    finally:
        printer.cancel()
        progress.finish(now())
    records.sort(key=lambda r: r.sent_s)
    return records
