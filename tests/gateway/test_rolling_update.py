"""Rolling updates under load lose no request, with streams running all along.

Workers: real worker processes behind a real gateway. A new worker joins, then the old ones
get SIGTERM one after another: each stops taking requests (a request that reaches it
meanwhile is refused before its first token and fails over), lets its running streams
finish, and exits 0. Routers: two replicas behind a client-side balancer that does what a
Service and its readiness probes do; a new replica joins, then an old one gets SIGTERM:
/ready turns 503 at once (the balancer drops it), new requests that still reach it get a
503 with Retry-After (retried elsewhere), its running streams finish, and it exits 0.
Every request is answered 200 with all its tokens."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
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


class Balancer:
    """What a Service in front of router replicas does: sends each request to a ready
    replica in turn, and takes a replica out once its readiness probe has failed
    FAILURE_THRESHOLD times in a row (every 100 ms here; a probe that times out fails, as
    Kubernetes counts it, so one slow answer on a busy machine does not drop a replica).
    Like an ingress, it retries a request that no replica took (refused connection, or 503
    before any byte) on the next one."""

    FAILURE_THRESHOLD = 3  # Kubernetes' default failureThreshold

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        self._turn = 0
        self.num_retried = 0
        self._failures: dict[str, int] = {}

    def next_url(self) -> str:
        self._turn += 1
        return self.urls[self._turn % len(self.urls)]

    async def probe_loop(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(timeout=1) as client:
            while not stop.is_set():
                for url in list(self.urls):
                    try:
                        ready = (await client.get(f"{url}/ready")).status_code == 200
                    except httpx.HTTPError:
                        ready = False
                    self._failures[url] = 0 if ready else self._failures.get(url, 0) + 1
                    if self._failures[url] >= self.FAILURE_THRESHOLD and len(self.urls) > 1:
                        self.urls.remove(url)
                await asyncio.sleep(0.1)


async def balanced_stream(
    client: httpx.AsyncClient, balancer: Balancer
) -> tuple[str, str, float, float]:
    """(outcome, the replica that answered, start, end): monotonic seconds."""
    for _ in range(4):
        url = balancer.next_url()
        started_s = time.monotonic()
        outcome = await one_stream(client, url)
        refused = outcome.startswith("status 503") or "ConnectError" in outcome
        if not refused:
            return outcome, url, started_s, time.monotonic()
        balancer.num_retried += 1
    return outcome, url, started_s, time.monotonic()


def test_routers_roll_under_load_and_no_request_is_lost() -> None:
    workers = [launch_worker(SIM_ARGS, timeout_s=120) for _ in range(2)]
    router_args = ["--served-model-name", MODEL, "--workers", ",".join(w.address for w in workers)]
    old = [launch_gateway(router_args) for _ in range(2)]
    new: list[GatewayProcess] = []
    try:
        for router in old:
            router.wait_ready(num_workers=2)
        balancer = Balancer([r.url for r in old])
        results: list[tuple[str, str, float, float]] = []
        stop = asyncio.Event()
        sigterm_s: dict[str, float] = {}

        async def client_loop() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                while not stop.is_set():
                    results.append(await balanced_stream(client, balancer))

        async def roll() -> list[int]:
            probes_done = asyncio.Event()
            probes = asyncio.create_task(balancer.probe_loop(probes_done))
            clients = [asyncio.create_task(client_loop()) for _ in range(NUM_CLIENTS)]
            codes = []
            for router in old:  # surge one, then stop one, as a Deployment's rollout does
                await asyncio.sleep(1.0)
                fresh = await asyncio.to_thread(launch_gateway, router_args)
                new.append(fresh)
                await asyncio.to_thread(fresh.wait_ready, num_workers=2)
                balancer.urls.append(fresh.url)
                await asyncio.sleep(0.5)
                sigterm_s[router.url] = time.monotonic()
                codes.append(await asyncio.to_thread(router.stop, signal.SIGTERM, 40.0))
            await asyncio.sleep(1.0)  # the new replicas alone
            stop.set()
            await asyncio.gather(*clients)
            probes_done.set()
            await probes
            return codes

        codes = asyncio.run(roll())
        failures = [r for r in results if r[0] != "ok"]
        assert not failures, f"{len(failures)} of {len(results)} lost: {failures[:5]}"
        assert codes == [0, 0]  # each old replica drained and exited cleanly
        # Not vacuous: each old replica was streaming when it was told to stop, and those
        # streams completed during its drain.
        for router in old:
            carried = [r for r in results if r[1] == router.url
                       and r[2] < sigterm_s[router.url] < r[3]]  # fmt: skip
            assert carried, f"{router.url} had no stream running at SIGTERM"
        assert {r[1] for r in results} >= {g.url for g in new}  # the new ones served
    finally:
        for router in [*old, *new]:
            router.stop(timeout_s=10)
        for w in workers:
            w.stop(timeout_s=10)
