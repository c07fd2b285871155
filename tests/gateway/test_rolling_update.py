"""A rolling update of the workers under load loses no request: real worker processes
behind a real gateway, streams running all along. A new worker joins, then the old ones
get SIGTERM one after another: each stops taking requests (a request that reaches it
meanwhile is refused before its first token and fails over), lets its running streams
finish, and exits 0. Every request is answered 200 with all its tokens."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from testkit.gateway_process import launch_gateway
from testkit.redis_server import free_port
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
# 10 ms a step: a 30-token answer streams for about 0.3 s, so each worker always has a
# few streams in flight when it is told to stop.
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "10",
            "--drain-timeout-s", "20"]  # fmt: skip
NUM_TOKENS = 30
NUM_CLIENTS = 4


async def one_stream(client: httpx.AsyncClient, url: str) -> str:
    """'ok', or what went wrong."""
    body = {"model": MODEL, "prompt": "Roll the fleet", "max_tokens": NUM_TOKENS,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {(await r.aread())[:200]!r}"
            usage, finish, done = None, None, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return f"error event {chunk['error']}"
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        finish = choice.get("finish_reason") or finish
            tokens = usage["completion_tokens"] if usage else None
            if not done or finish != "length" or tokens != NUM_TOKENS:
                return f"incomplete: done={done} finish={finish} tokens={tokens}"
            return "ok"
    except httpx.HTTPError as exc:
        return f"transport {exc!r}"


def test_workers_roll_under_load_and_no_request_is_lost() -> None:
    old = [launch_worker(SIM_ARGS, timeout_s=120) for _ in range(2)]
    new_port = free_port()
    new: WorkerProcess | None = None
    addresses = ",".join([*(w.address for w in old), f"127.0.0.1:{new_port}"])
    gateway = launch_gateway(["--served-model-name", MODEL, "--workers", addresses])
    try:
        gateway.wait_ready(num_workers=2)
        results: list[str] = []
        stop = asyncio.Event()

        async def client_loop() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                while not stop.is_set():
                    results.append(await one_stream(client, gateway.url))

        async def roll() -> list[int]:
            nonlocal new
            clients = [asyncio.create_task(client_loop()) for _ in range(NUM_CLIENTS)]
            await asyncio.sleep(1.0)
            new = await asyncio.to_thread(
                launch_worker, [*SIM_ARGS, "--port", str(new_port)], timeout_s=120
            )
            await asyncio.to_thread(gateway.wait_ready, num_workers=3)
            codes = []
            for worker in old:  # one at a time, as a Deployment's rollout does
                await asyncio.sleep(1.0)
                codes.append(await asyncio.to_thread(worker.stop, signal.SIGTERM, 30.0))
            await asyncio.sleep(1.0)  # the new worker alone
            stop.set()
            await asyncio.gather(*clients)
            return codes

        started = time.monotonic()
        codes = asyncio.run(roll())
        failures = [r for r in results if r != "ok"]
        assert not failures, f"{len(failures)} of {len(results)} lost: {failures[:5]}"
        assert codes == [0, 0]  # each old worker drained and exited cleanly
        assert len(results) >= 20, (len(results), time.monotonic() - started)
    finally:
        gateway.stop()
        for w in [*old, *([new] if new is not None else [])]:
            w.stop(timeout_s=10)
