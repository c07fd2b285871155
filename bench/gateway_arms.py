"""The gateway benchmark's arms: the direct arm (client -> stub workers over gRPC) and each
gateway arm (client -> gateway over HTTP -> the same stubs), measured open loop, closed loop
or paired (bench/gateway_overhead.py; the processes: bench/gateway_procs.py)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from gateway_http import HttpClient, wait_ready
from gateway_load import Sender, closed_loop, open_loop, paired_run
from gateway_procs import MODEL, GatewayArm, start_gateway_arm

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

MESSAGES = [{"role": "user", "content": "Summarize the plot of Hamlet in two sentences."}]


def direct_sender(stubs: list[Any], prompt_ids: list[int]) -> Callable[[int], Sender]:
    counter = itertools.count()

    def make(max_tokens: int) -> Sender:
        async def send() -> None:
            n = next(counter)
            request = pb.GenerateRequest(
                request_id=f"direct-{n}",
                prompt_token_ids=prompt_ids,
                sampling=pb.SamplingParams(max_tokens=max_tokens),
            )
            async for message in stubs[n % len(stubs)].Generate(request):
                if message.finish_reason:
                    return

        return send

    return make


# The same request in each API's words: the chat completion, or the Response (its default
# store: true, so the measure includes keeping it).
ENDPOINTS = ("chat", "responses")


def gateway_sender(
    http: HttpClient, headers: dict[str, str], endpoint: str = "chat"
) -> Callable[[int], Sender]:
    assert endpoint in ENDPOINTS, endpoint

    def make(max_tokens: int) -> Sender:
        if endpoint == "chat":
            path, request = "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": max_tokens}
        else:
            path, request = "/v1/responses", {"input": MESSAGES, "max_output_tokens": max_tokens}
        body = json.dumps({"model": MODEL, **request}).encode()

        async def send() -> None:
            status, _ = await http.post(path, body, headers)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")

        return send

    return make


async def measure(
    arm: str,
    make: Callable[[int], Sender],
    args: argparse.Namespace,
    cpu: Callable[[], dict[str, float]],
    *,
    with_throughput: bool,
    measurement_starts: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Warm-up, the open-loop latency run (with each process's CPU per request), and
    optionally the closed-loop throughput and the open-loop check at --target-rate."""
    await closed_loop(make(16), 8, 1.0)  # connections, tokenizer, hash memo, caches
    measurement_starts()
    cpu_before, client_before = cpu(), time.process_time()
    result: dict[str, Any] = asdict(await open_loop(arm, make(16), args.rate, args.duration_s, 1))
    num = result["latency"]["n"] or 1
    cpu_after = cpu()
    result["cpu_ms_per_request"] = {
        name: 1e3 * (cpu_after[name] - cpu_before[name]) / num for name in cpu_after
    } | {"load_generator": 1e3 * (time.process_time() - client_before) / num}
    if with_throughput:
        result["throughput_closed_loop"] = await closed_loop(
            make(1), args.concurrency, args.throughput_s
        )
        if arm != "direct":
            result["target_rate_check"] = asdict(
                await open_loop(arm, make(1), args.target_rate, args.throughput_s, seed=2)
            )
    return result


async def direct_arm(
    addresses: list[str], prompt_ids: list[int], stub_cpu: Callable[[], float],
    args: argparse.Namespace, *, with_throughput: bool,
) -> dict[str, Any]:  # fmt: skip
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    make = direct_sender([pb_grpc.WorkerStub(c) for c in channels], prompt_ids)
    try:
        return await measure("direct", make, args, lambda: {"stubs": stub_cpu()},
                             with_throughput=with_throughput)  # fmt: skip
    finally:
        for c in channels:
            await c.close()


async def gateway_arm(
    arm: GatewayArm, stub_cpu: Callable[[], float], args: argparse.Namespace,
    *, with_throughput: bool,
) -> dict[str, Any]:  # fmt: skip
    http = HttpClient("127.0.0.1", int(arm.url.rsplit(":", 1)[1]))
    try:
        result = await measure(arm.name, gateway_sender(http, arm.headers), args,
                               lambda: arm.cpu_s() | {"stubs": stub_cpu()},
                               with_throughput=with_throughput,
                               measurement_starts=arm.measurement_starts)  # fmt: skip
    finally:
        await http.close()
    if arm.name != "open":
        # What the quota store recorded: "cluster" scope means Redis held it; its request
        # count shows every request was settled (the deferred arm's after its response).
        await asyncio.sleep(0.5)
        result["usage"] = await asyncio.to_thread(read_usage, arm)
    return result


async def paired_arm(
    arm: GatewayArm, addresses: list[str], prompt_ids: list[int], args: argparse.Namespace,
    endpoint: str = "chat",
) -> dict[str, Any]:  # fmt: skip
    http = HttpClient("127.0.0.1", int(arm.url.rsplit(":", 1)[1]))
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        direct = direct_sender([pb_grpc.WorkerStub(c) for c in channels], prompt_ids)(16)
        gateway = gateway_sender(http, arm.headers, endpoint)(16)
        return await paired_run(
            direct, gateway, num_idle=args.paired_idle, rate=args.rate,
            duration_s=args.duration_s,
        )  # fmt: skip
    finally:
        await http.close()
        for c in channels:
            await c.close()


def run_paired(
    name: str, addresses: list[str], prompt_ids: list[int], args: argparse.Namespace,
    workdir: Path, endpoint: str = "chat",
) -> dict[str, Any]:  # fmt: skip
    print(f"  {name} (paired: the same request direct and through the gateway's {endpoint} "
          "endpoint)", flush=True)  # fmt: skip
    arm = start_gateway_arm(name, addresses, workdir)
    try:
        wait_gateway(arm.url, len(addresses))
        return asyncio.run(paired_arm(arm, addresses, prompt_ids, args, endpoint))
    finally:
        arm.stop()


def read_usage(arm: GatewayArm) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(f"{arm.url}/v1/usage", headers=arm.headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        usage: dict[str, Any] = json.load(r)
        return usage


def run_gateway_arm(
    name: str, addresses: list[str], stub_cpu: Callable[[], float], args: argparse.Namespace,
    workdir: Path, *, stage_times: Path | None = None, with_throughput: bool = True,
) -> dict[str, Any]:  # fmt: skip
    print(f"  {name}{' (instrumented)' if stage_times else ''}", flush=True)
    arm = start_gateway_arm(name, addresses, workdir, stage_times=stage_times)
    try:
        wait_gateway(arm.url, len(addresses))
        return asyncio.run(gateway_arm(arm, stub_cpu, args, with_throughput=with_throughput))
    finally:
        arm.stop()


def wait_gateway(url: str, num_workers: int) -> None:
    wait_ready(url, num_workers, timeout_s=60, poll_s=0.2)
