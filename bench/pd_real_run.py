"""One run of `bench/pd_real.py`: one arm's gateway, one repetition's open-loop traffic.

The harness's open-loop runner sends every request at its scheduled time; a client that
records each request as it ends lets the run stop as soon as the last *measured* request
is done, cancelling the cool-down's (the gateway then aborts them on the workers). Before
the run the arm's workers must be idle; around it, CPU seconds and the gateway's PD
counters are read, so a run says what it cost and which plans it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
from dataclasses import asdict
from typing import Any

from pd_real_pool import (
    MODEL_NAME,
    Arm,
    Pool,
    counter_delta,
    cpu_snapshot,
    cpu_usage,
    pd_counters,
    wait_idle,
)
from pd_real_traffic import Traffic, requests_for, schedule, summarize_run

from kvflow.loadgen.client import BenchClient, Clock
from kvflow.loadgen.payloads import Api, EndpointConfig
from kvflow.loadgen.progress import Progress
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.runner import run_open_loop
from kvflow.loadgen.summary import ScheduleLimits


class RecordingClient(BenchClient):
    """Keeps every record as it ends and says when the measured ones are all done, so the
    run can stop without waiting for the cool-down's requests."""

    def __init__(self, config: EndpointConfig, measured_ids: set[str]) -> None:
        super().__init__(config)
        self.records: list[RequestRecord] = []
        self._pending = set(measured_ids)
        self.measured_done = asyncio.Event()
        if not self._pending:
            self.measured_done.set()

    async def send(
        self, request_id: str, body: bytes, *, scheduled_s: float | None, now: Clock
    ) -> RequestRecord:
        record = await super().send(request_id, body, scheduled_s=scheduled_s, now=now)
        self.records.append(record)
        self._pending.discard(request_id)
        if not self._pending:
            self.measured_done.set()
        return record


async def drive(
    gateway_url: str, traffic: Traffic, seed: int, repetition: int, content: str, label: str
) -> list[RequestRecord]:
    arrivals = schedule(traffic, seed, repetition)
    requests = requests_for(arrivals, content)
    measured = {r.request_id for r, a in zip(requests, arrivals, strict=True)
                if traffic.warmup_s <= a.offset_s < traffic.horizon_s}  # fmt: skip
    config = EndpointConfig(f"{gateway_url}/v1", MODEL_NAME, api=Api.COMPLETIONS,
                            request_timeout_s=600)  # fmt: skip
    client = RecordingClient(config, measured)
    progress = Progress(label, arrivals[-1].offset_s, len(requests), sys.stderr)
    runner = asyncio.create_task(
        run_open_loop(client, requests, [a.offset_s for a in arrivals], progress)
    )
    done = asyncio.create_task(client.measured_done.wait())
    try:
        await asyncio.wait({runner, done}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (runner, done):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await client.aclose()
    return client.records


def run_arm(
    pool: Pool, arm: Arm, traffic: Traffic, seed: int, repetition: int, limits: ScheduleLimits
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Drive ``arm`` with repetition ``repetition`` of ``traffic``; the run's JSON record
    (summary, validity, PD counters, CPU) and its request records."""
    workers = [pool.workers[w] for w in arm.workers]
    is_idle = wait_idle(workers)
    gateway = pool.gateways[arm.name]
    pids = pool.pids(arm)
    counters, cpu = pd_counters(gateway), cpu_snapshot(pids)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    rate = traffic.stream_rate_per_s
    label = f"{arm.name} @{rate:g}/s #{repetition}"
    content = f"{arm.name}/{rate:g}/{repetition}"
    records = asyncio.run(drive(gateway.url, traffic, seed, repetition, content, label))
    cpu_after, counters_after = cpu_snapshot(pids), pd_counters(gateway)
    summary = summarize_run(records, traffic, limits)
    problems = list(summary.schedule.problems)
    if not is_idle:
        problems.append("the workers were still busy from the previous run at its start")
    run = {
        "arm": arm.name,
        "stream_rate_per_s": rate,
        "repetition": repetition,
        "started_utc": started,
        "valid": not problems,
        "problems": problems,
        "summary": asdict(summary),
        "pd_counters": counter_delta(counters, counters_after),
        "cpu": cpu_usage(cpu, cpu_after),
        "records": [asdict(r) for r in records],
    }
    return run, records
