"""KV-aware routing with real simulated worker processes: prefix locality, load, a killed
worker, a restarted worker, a restarted router."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

import grpc
import httpx
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "2",
            "--num-kv-blocks", "4096"]  # fmt: skip
PREFIX = list(range(1000, 1512))  # 32 blocks of 16


@contextmanager
def cluster(
    num_workers: int, *worker_args: str
) -> Iterator[tuple[GatewayProcess, list[WorkerProcess]]]:
    with ExitStack() as stack:
        workers = []
        for _ in range(num_workers):
            w = launch_worker([*SIM_ARGS, *worker_args], timeout_s=120)
            stack.callback(w.stop, timeout_s=10)
            workers.append(w)
        g = launch_gateway(["--served-model-name", MODEL,
                            "--workers", ",".join(w.address for w in workers)])  # fmt: skip
        stack.callback(g.stop)
        g.wait_ready(num_workers=num_workers)
        yield g, workers


def complete(g: GatewayProcess, prompt: list[int], max_tokens: int = 4) -> tuple[str, int, dict]:
    """(chosen worker, prefix blocks it held per the router, the response body)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{g.base_url}/completions", json=body, headers={"x-kvflow-route": "1"},
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    last_route = r.headers["x-kvflow-route"].split(", ")[-1]
    worker = re.search(r"worker=([^;]+)", last_route).group(1)  # type: ignore[union-attr]
    blocks = int(float(re.search(r"prefix_blocks=([^;]+)", last_route).group(1)))  # type: ignore[union-attr]
    return worker, blocks, r.json()


def metric(g: GatewayProcess, name: str) -> float:
    for line in httpx.get(f"{g.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def outcomes(g: GatewayProcess) -> dict[str, int]:
    """kvflow_router_prefix_outcomes_total by outcome (those counted so far)."""
    found = {}
    for line in httpx.get(f"{g.url}/metrics").text.splitlines():
        if match := re.match(r'kvflow_router_prefix_outcomes_total\{outcome="(\w+)"\} (\S+)', line):
            found[match.group(1)] = int(float(match.group(2)))
    return found


def wait_indexed(g: GatewayProcess, num_blocks: int, timeout_s: float = 10) -> None:
    """Until the router's index holds ``num_blocks`` distinct blocks (KV events arrived)."""
    deadline = time.monotonic() + timeout_s
    while metric(g, "kvflow_router_index_blocks") < num_blocks:
        assert time.monotonic() < deadline, "KV events did not reach the router's index"
        time.sleep(0.05)


def test_a_repeated_long_prefix_lands_on_the_worker_that_holds_it() -> None:
    with cluster(4) as (g, _):
        holder, blocks, _ = complete(g, [*PREFIX, 1])
        assert blocks == 0
        wait_indexed(g, 32)
        for suffix in range(2, 8):
            worker, blocks, body = complete(g, [*PREFIX, suffix, suffix])
            assert worker == holder
            assert blocks == 32
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        # A prompt with another prefix is free to go anywhere: nobody holds its blocks.
        _, blocks, _ = complete(g, list(range(5000, 5100)))
        assert blocks == 0
        # Where each went relative to its prompt's best holder: the first and the stranger
        # found the prefix nowhere, the six others on its holder.
        assert outcomes(g) == {"best_holder": 6, "no_prefix": 2}


def test_a_loaded_worker_is_avoided_despite_its_cache() -> None:
    short_prefix = PREFIX[:128]  # 8 blocks
    with cluster(2) as (g, workers):
        holder, _, _ = complete(g, [*short_prefix, 1])
        wait_indexed(g, 8)
        busy = next(w for w in workers if w.address == holder)
        stop = threading.Event()

        def occupy(i: int) -> None:
            # Long generations straight to the worker, past the router: only its Load
            # reports show them.
            with grpc.insecure_channel(busy.address) as channel:
                request = pb.GenerateRequest(
                    request_id=f"load-{i}",
                    prompt_token_ids=list(range(9000 + i * 50, 9040 + i * 50)),
                    sampling=pb.SamplingParams(max_tokens=5000, ignore_eos=True),
                )
                call = pb_grpc.WorkerStub(channel).Generate(request)
                for _ in call:
                    if stop.is_set():
                        call.cancel()
                        return

        with ThreadPoolExecutor(max_workers=12) as pool:
            for i in range(12):
                pool.submit(occupy, i)
            try:
                # No sleeps: first the worker itself reports the 12 requests ...
                with grpc.insecure_channel(busy.address) as channel:
                    stub = pb_grpc.WorkerStub(channel)
                    deadline = time.monotonic() + 30
                    while (load := stub.Load(pb.LoadRequest(), timeout=5)).num_running + (
                        load.num_waiting
                    ) < 12:
                        assert time.monotonic() < deadline, f"the load never arrived: {load}"
                        time.sleep(0.02)
                # ... then the router, which polls Load every 250 ms, must turn away within
                # a few polls. Until it knows, prompts sharing the prefix still land on the
                # holder (8 cached blocks); a router blind to load never turns away.
                deadline = time.monotonic() + 5
                suffix = 2
                while (chosen := complete(g, [*short_prefix, suffix]))[0] == holder:
                    assert time.monotonic() < deadline, "the loaded holder is still chosen"
                    suffix += 1
                worker, blocks, _ = chosen
                # 8 cached blocks there, but 12 requests queued: the other worker wins.
                assert worker != holder and blocks == 0
                assert outcomes(g)["passed_over"] == 1
            finally:
                stop.set()


def test_a_killed_worker_is_failed_over() -> None:
    with cluster(2) as (g, workers):
        holder, _, _ = complete(g, [*PREFIX, 1])
        wait_indexed(g, 32)
        victim = next(w for w in workers if w.address == holder)
        survivor = next(w for w in workers if w.address != holder)
        victim.stop(sig=signal.SIGKILL)
        # Sent at once, while the router's index still points at the dead worker.
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda s: complete(g, [*PREFIX, s]), range(2, 10)))
        assert {worker for worker, _, _ in results} == {survivor.address}
        assert httpx.get(f"{g.url}/ready").json()["workers_healthy"] == 1


def test_a_restarted_worker_loses_its_index_entries() -> None:
    port = free_port()
    with cluster(1, "--port", str(port)) as (g, (worker,)):
        complete(g, [*PREFIX, 1])
        wait_indexed(g, 32)
        worker.stop(sig=signal.SIGKILL)
        restarted = launch_worker([*SIM_ARGS, "--port", str(port)], timeout_s=120)
        try:
            deadline = time.monotonic() + 20
            while True:  # until the router saw the restart and its (empty) snapshot
                ready = httpx.get(f"{g.url}/ready").json()["workers_healthy"] == 1
                if ready and metric(g, "kvflow_router_index_blocks") == 0:
                    break
                assert time.monotonic() < deadline, "stale index entries were not dropped"
                time.sleep(0.1)
            _, blocks, body = complete(g, [*PREFIX, 2])
            assert blocks == 0
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        finally:
            restarted.stop(timeout_s=10)


def test_a_restarted_router_rebuilds_its_index_from_snapshots() -> None:
    with cluster(3) as (g, workers):
        holder, _, _ = complete(g, [*PREFIX, 1])
        wait_indexed(g, 32)
        g.stop()
        fresh = launch_gateway(["--served-model-name", MODEL,
                                "--workers", ",".join(w.address for w in workers)])  # fmt: skip
        try:
            fresh.wait_ready(num_workers=3)
            wait_indexed(fresh, 32)
            worker, blocks, _ = complete(fresh, [*PREFIX, 2])
            assert (worker, blocks) == (holder, 32)
        finally:
            fresh.stop()
