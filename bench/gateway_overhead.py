"""What the gateway costs: routing decision time, added latency, and the rate it holds.

Three parts, one invocation, same seed:
  decision   in-process: the routing pipeline (block hashing, index lookup, scorers,
             picker) for 8k-token prompts over 16 workers; cached, half-cached and cold
             prompts, and hashing without the per-block memo for comparison.
  latency    open-loop Poisson arrivals at --rate req/s of a short chat request (16 output
             tokens). The direct arm: client -> stub workers over gRPC (pre-tokenized
             prompt), measured while no gateway runs (no probes, no event streams), first
             and once more at the end as a drift check. Then each gateway arm in turn, its
             gateway (and redis-server) started for it and stopped after it: client ->
             gateway (HTTP, auth, template, tokenizer, quotas, routing, detokenization) ->
             the same stubs. Arms (bench/gateway_procs.py): open (no tenants),
             tenants (in-process quotas), tenants-redis (quotas in a real redis-server: the
             multi-tenant deployment's path), tenants-redis-deferred (a what-if: quota
             settlement after the response). Added latency = arm - direct. Each arm also
             reports the CPU its processes spent per request.
  throughput the highest rate each arm holds with 1-token answers: closed loop at a fixed
             concurrency, and an open-loop check at --target-rate.

--paired times the same request both ways, per request, while the gateway runs: for each
gateway arm, first one pair at a time on an idle machine (direct, then through the
gateway, the order alternating), then Poisson arrivals at --rate where each arrival sends
both at once. Added latency per request = its gateway time - its direct time; the report
gives that difference's percentiles (not a difference of percentiles). --paired-only
skips the other parts.

--stages re-runs tenants-redis with wall-clock timers around the request's stages
(bench/gateway_instrumented.py): where the time goes.

Stub workers (bench/gateway_stub_worker.py) answer instantly and publish KV events, so
the numbers are the gateway's own cost plus loopback gRPC. Everything shares this
machine's cores: the load generator, the gateway, redis-server and the stubs.

    python bench/gateway_overhead.py [--quick] [--stages] [--arms open,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from gateway_http import HttpClient  # noqa: E402
from gateway_procs import (  # noqa: E402
    GATEWAY_ARMS,
    MODEL,
    GatewayArm,
    cpu_s,
    start,
    start_gateway_arm,
    stop,
)
from gateway_report import print_report  # noqa: E402

from kvflow.proto import worker_pb2 as pb  # noqa: E402
from kvflow.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from kvflow.proto.block_hash import block_hashes, iter_block_hashes, make_hash_seed  # noqa: E402
from kvflow.proto.roles import Role  # noqa: E402
from kvflow.router.routing.block_hasher import CachedBlockHasher  # noqa: E402
from kvflow.router.routing.block_index import BlockIndex  # noqa: E402
from kvflow.router.routing.pipeline import DEFAULT_WEIGHTS, build_pipeline  # noqa: E402
from kvflow.router.routing.sessions import SessionTable  # noqa: E402
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView  # noqa: E402
from kvflow.router.text.model_files import load_text_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "Summarize the plot of Hamlet in two sentences."}]


Sender = Callable[[], Awaitable[None]]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    return {"p50_ms": percentile(ms, 50), "p90_ms": percentile(ms, 90),
            "p99_ms": percentile(ms, 99), "n": len(ms)}  # fmt: skip


# -- part 1: decision time ------------------------------------------------------------------


def decision_benchmark(num_workers: int, prompt_tokens: int, num_decisions: int) -> dict[str, Any]:
    rng = random.Random(0)
    seed, salt, block = make_hash_seed(MODEL), "tenant-a", 16
    index, sessions = BlockIndex(), SessionTable()
    pipeline = build_pipeline(DEFAULT_WEIGHTS, index=index, sessions=sessions, rng=rng)
    hasher = CachedBlockHasher()
    workers = [
        WorkerView(WorkerId(f"10.0.0.{i}:50051"), MODEL, Role.COLOCATED, True,
                   queue_depth=rng.randrange(8), kv_usage=rng.random() / 2)
        for i in range(num_workers)
    ]  # fmt: skip
    # One long document per worker, cached there (as after an earlier request).
    documents = [[rng.randrange(49152) for _ in range(prompt_tokens)] for _ in workers]
    for worker, doc in zip(workers, documents, strict=True):
        index.add(worker.worker_id, block_hashes(doc, block_size=block, seed=seed, salt=salt))
        list(hasher.iter_hashes(doc, block_size=block, seed=seed, salt=salt))
    num_cached = prompt_tokens * 3 // 4

    def prompts(kind: str) -> list[int]:
        doc = rng.choice(documents)
        if kind == "cached":
            return doc
        if kind == "three_quarters_cached":
            return doc[:num_cached] + [
                rng.randrange(49152) for _ in range(prompt_tokens - num_cached)
            ]
        return [rng.randrange(49152) for _ in range(prompt_tokens)]

    results: dict[str, Any] = {"num_workers": num_workers, "prompt_tokens": prompt_tokens}
    for kind in ("cached", "three_quarters_cached", "cold"):
        samples = [prompts(kind) for _ in range(num_decisions)]
        times = []
        for tokens in samples:
            started = time.perf_counter()
            hashes = hasher.iter_hashes(tokens, block_size=block, seed=seed, salt=salt)
            decision = pipeline.route(RouteRequest(MODEL, hashes), workers)
            times.append(time.perf_counter() - started)
            assert decision is not None
        results[kind] = summary_ms(times)
    # The same cached decisions with the chain hashed from scratch each time (no memo).
    times = []
    for _ in range(num_decisions):
        tokens = rng.choice(documents)
        started = time.perf_counter()
        hashes = iter_block_hashes(tokens, block_size=block, seed=seed, salt=salt)
        pipeline.route(RouteRequest(MODEL, hashes), workers)
        times.append(time.perf_counter() - started)
    results["cached_without_hash_memo"] = summary_ms(times)
    return results


# -- load generation ------------------------------------------------------------------------


@dataclass
class LoadResult:
    arm: str
    target_rate: float
    achieved_rate: float
    latency: dict[str, float]
    schedule_delay: dict[str, float]
    num_errors: int
    is_valid: bool


async def open_loop(
    arm: str, send: Callable[[], Awaitable[None]], rate: float, duration_s: float, seed: int
) -> LoadResult:
    """Poisson arrivals; each request's latency is measured from its scheduled time, so a
    late load generator shows up as latency and schedule delay, not as a lighter load."""
    rng = random.Random(seed)
    latencies: list[float] = []
    delays: list[float] = []
    errors = 0
    tasks: list[asyncio.Task[None]] = []

    async def one(scheduled: float) -> None:
        nonlocal errors
        delays.append(time.perf_counter() - scheduled)
        try:
            await send()
        except Exception:  # a benchmark counts failures, whatever they are
            errors += 1
            return
        latencies.append(time.perf_counter() - scheduled)

    begin = time.perf_counter()
    at = begin
    while at - begin < duration_s:
        at += rng.expovariate(rate)
        sleep_s = at - time.perf_counter()
        if sleep_s > 0:
            await asyncio.sleep(sleep_s)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - begin
    achieved = len(latencies) / elapsed
    delay = summary_ms(delays)
    # Invalid when the generator could not keep its schedule or the target was not met.
    valid = achieved >= 0.95 * rate and delay["p99_ms"] < 10 and errors == 0
    return LoadResult(arm, rate, achieved, summary_ms(latencies), delay, errors, valid)


async def closed_loop(
    send: Callable[[], Awaitable[None]], concurrency: int, duration_s: float
) -> float:
    done = 0
    stop_at = time.perf_counter() + duration_s

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await send()
            done += 1

    begin = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / (time.perf_counter() - begin)


# -- arms -----------------------------------------------------------------------------------


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


def gateway_sender(http: HttpClient, headers: dict[str, str]) -> Callable[[int], Sender]:
    def make(max_tokens: int) -> Sender:
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens}).encode()

        async def send() -> None:
            status, _ = await http.post("/v1/chat/completions", body, headers)
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


async def timed(send: Sender) -> float:
    started = time.perf_counter()
    await send()
    return time.perf_counter() - started


async def paired_run(
    direct: Sender, gateway: Sender, *, num_idle: int, rate: float, duration_s: float
) -> dict[str, Any]:
    """The same request direct and through the gateway: per-request differences."""
    for _ in range(20):  # warm-up: connections, caches
        await direct()
        await gateway()
    idle: list[float] = []
    for i in range(num_idle):
        if i % 2:
            g, d = await timed(gateway), await timed(direct)
        else:
            d, g = await timed(direct), await timed(gateway)
        idle.append(g - d)
    rng = random.Random(3)
    loaded: list[float] = []
    direct_s: list[float] = []
    gateway_s: list[float] = []
    errors = 0

    async def pair() -> None:
        nonlocal errors
        try:
            d, g = await asyncio.gather(timed(direct), timed(gateway))
        except Exception:  # a benchmark counts failures, whatever they are
            errors += 1
            return
        direct_s.append(d)
        gateway_s.append(g)
        loaded.append(g - d)

    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    at = begin
    while at - begin < duration_s:
        at += rng.expovariate(rate)
        sleep_s = at - time.perf_counter()
        if sleep_s > 0:
            await asyncio.sleep(sleep_s)
        tasks.append(asyncio.create_task(pair()))
    await asyncio.gather(*tasks)
    return {
        "idle_added": summary_ms(idle),
        "loaded_rate_per_s": rate,
        "loaded_added": summary_ms(loaded),
        "loaded_direct": summary_ms(direct_s),
        "loaded_gateway": summary_ms(gateway_s),
        "loaded_errors": errors,
    }


async def paired_arm(
    arm: GatewayArm, addresses: list[str], prompt_ids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    http = HttpClient("127.0.0.1", int(arm.url.rsplit(":", 1)[1]))
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        direct = direct_sender([pb_grpc.WorkerStub(c) for c in channels], prompt_ids)(16)
        gateway = gateway_sender(http, arm.headers)(16)
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
    workdir: Path,
) -> dict[str, Any]:  # fmt: skip
    print(f"  {name} (paired: the same request direct and through the gateway)", flush=True)
    arm = start_gateway_arm(name, addresses, workdir)
    try:
        wait_gateway(arm.url, len(addresses))
        return asyncio.run(paired_arm(arm, addresses, prompt_ids, args))
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


def wait_gateway(url: str, num_workers: int, timeout_s: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if json.load(r)["workers_healthy"] >= num_workers:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("gateway not ready")


def main() -> None:
    p = argparse.ArgumentParser(description="Gateway overhead benchmark (docs/benchmarks.md).")
    p.add_argument("--quick", action="store_true", help="short runs, 4 stub workers")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workers", type=int, help="stub workers (default 16; 4 with --quick)")
    p.add_argument("--rate", type=float, default=100.0, help="req/s of the latency arms")
    p.add_argument("--target-rate", type=float, default=300.0, help="req/s to check")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument(
        "--arms",
        default="open,tenants-redis,tenants-redis-deferred",
        help=f"gateway arms, of {','.join(GATEWAY_ARMS)}",
    )
    p.add_argument(
        "--stages",
        action="store_true",
        help="then re-run tenants-redis instrumented: wall time per request stage",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="also time the same request direct and through each gateway arm, per request",
    )
    p.add_argument("--paired-only", action="store_true", help="only the paired part")
    p.add_argument("--paired-idle", type=int, help="idle pairs per arm (400; quick 100)")
    p.add_argument("--duration-s", type=float, help="each latency run (30; quick 8)")
    p.add_argument("--throughput-s", type=float, help="each throughput run (15; quick 5)")
    args = p.parse_args()
    args.workers = args.workers or (4 if args.quick else 16)
    args.duration_s = args.duration_s or (8.0 if args.quick else 30.0)
    args.throughput_s = args.throughput_s or (5.0 if args.quick else 15.0)
    args.paired_idle = args.paired_idle or (100 if args.quick else 400)
    args.paired = args.paired or args.paired_only
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(GATEWAY_ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(GATEWAY_ARMS)}")
    num_decisions = 300 if args.quick else 2000
    load_before = os.getloadavg()

    decision = None
    if not args.paired_only:
        print(f"decision time: 8192-token prompts, 16 workers, {num_decisions} decisions")
        decision = decision_benchmark(16, 8192, num_decisions)
    text = load_text_model(None)
    assert text.chat_template is not None
    prompt_ids = text.tokenizer.encode(
        text.chat_template.render(MESSAGES), add_special_tokens=False
    )
    stubs: list[subprocess.Popen[str]] = []
    results: dict[str, Any] = {}
    paired: dict[str, Any] = {}
    stages = None
    try:
        addresses = []
        for _ in range(args.workers):
            proc, line = start([sys.executable, str(ROOT / "gateway_stub_worker.py"),
                                "--model", MODEL], "STUB_WORKER_READY")  # fmt: skip
            stubs.append(proc)
            addresses.append(f"127.0.0.1:{line.split('port=')[1]}")

        def stub_cpu() -> float:
            return sum(cpu_s(s.pid) for s in stubs)

        print(f"{args.workers} stub workers up; arms (one process set at a time):", flush=True)
        if not args.paired_only:
            print("  direct (no gateway running)", flush=True)
            results["direct"] = asyncio.run(
                direct_arm(addresses, prompt_ids, stub_cpu, args, with_throughput=True)
            )
        with tempfile.TemporaryDirectory(prefix="kvflow-gw-bench-") as tmp:
            workdir = Path(tmp)
            for name in arms if not args.paired_only else []:
                results[name] = run_gateway_arm(name, addresses, stub_cpu, args, workdir)
            for name in arms if args.paired else []:
                paired[name] = run_paired(name, addresses, prompt_ids, args, workdir)
            if args.stages and not args.paired_only:
                path = workdir / "stages.json"
                results["tenants-redis (instrumented)"] = run_gateway_arm(
                    "tenants-redis", addresses, stub_cpu, args, workdir,
                    stage_times=path, with_throughput=False,
                )  # fmt: skip
                stages = json.loads(path.read_text())
        if not args.paired_only:
            print("  direct again (drift check)", flush=True)
            results["direct (again)"] = asyncio.run(
                direct_arm(addresses, prompt_ids, stub_cpu, args, with_throughput=False)
            )
    finally:
        stop(stubs)

    added = {}
    if "direct" in results:
        direct = results["direct"]["latency"]
        added = {
            arm: {q: r["latency"][q] - direct[q] for q in ("p50_ms", "p90_ms", "p99_ms")}
            for arm, r in results.items()
            if not arm.startswith("direct")
        }
    report = {
        "benchmark": "gateway_overhead",
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"json": str(args.json)},
        "decision": decision,
        "arms": results,
        "added_ms": added,
        "paired": paired,
        "stages": stages,
    }  # fmt: skip
    if results:
        print_report(report)
    print_paired(paired)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


def print_paired(paired: dict[str, Any]) -> None:
    if not paired:
        return
    print("\nadded latency per request (gateway time - direct time of the same request), ms")
    print(f"{'arm':<26} {'idle P50':>9} {'P90':>7} {'P99':>7}   {'loaded P50':>10} {'P90':>7} "
          f"{'P99':>7} {'errors':>6}")  # fmt: skip
    for name, r in paired.items():
        i, lo = r["idle_added"], r["loaded_added"]
        print(f"{name:<26} {i['p50_ms']:>9.2f} {i['p90_ms']:>7.2f} {i['p99_ms']:>7.2f}   "
              f"{lo['p50_ms']:>10.2f} {lo['p90_ms']:>7.2f} {lo['p99_ms']:>7.2f} "
              f"{r['loaded_errors']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
