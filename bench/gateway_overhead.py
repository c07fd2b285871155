"""What the gateway costs: routing decision time, added latency, and the rate it holds.

Three parts, one invocation, same seed:
  decision   in-process: the routing pipeline (block hashing, index lookup, scorers,
             picker) for 8k-token prompts over 16 workers; cached, half-cached and cold
             prompts, and hashing without the per-block memo for comparison.
  latency    open-loop Poisson arrivals at --rate req/s of a short chat request (16 output
             tokens), two arms: client -> stub workers directly over gRPC (pre-tokenized
             prompt), and client -> gateway (HTTP, template, tokenizer, quotas, routing,
             detokenization) -> the same stub workers. Added latency = gateway - direct.
  throughput the highest rate the gateway holds with 1-token answers: closed loop at a
             fixed concurrency, and an open-loop check at --target-rate.

Stub workers (bench/gateway_stub_worker.py) answer instantly and publish KV events, so
the numbers are the gateway's own cost plus loopback gRPC. Everything shares this
machine's cores: the load generator, the gateway and the stubs.

    python bench/gateway_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from gateway_http import HttpClient  # noqa: E402

from kvflow.proto import worker_pb2 as pb  # noqa: E402
from kvflow.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from kvflow.proto.block_hash import block_hashes, iter_block_hashes, make_hash_seed  # noqa: E402
from kvflow.router.routing.block_hasher import CachedBlockHasher  # noqa: E402
from kvflow.router.routing.block_index import BlockIndex  # noqa: E402
from kvflow.router.routing.pipeline import DEFAULT_WEIGHTS, build_pipeline  # noqa: E402
from kvflow.router.routing.sessions import SessionTable  # noqa: E402
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerRole, WorkerView  # noqa: E402
from kvflow.router.text.model_files import load_text_model  # noqa: E402

MODEL = "stub"
MESSAGES = [{"role": "user", "content": "Summarize the plot of Hamlet in two sentences."}]


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
        WorkerView(WorkerId(f"10.0.0.{i}:50051"), MODEL, WorkerRole.BOTH, True,
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


# -- processes ------------------------------------------------------------------------------


def start(cmd: list[str], ready: str, timeout_s: float = 120) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line.strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")


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


async def run_arms(url: str, addresses: list[str], args: argparse.Namespace) -> dict[str, Any]:
    text = load_text_model(None)
    assert text.chat_template is not None
    prompt_ids = text.tokenizer.encode(
        text.chat_template.render(MESSAGES), add_special_tokens=False
    )
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.WorkerStub(c) for c in channels]
    http = HttpClient("127.0.0.1", int(url.rsplit(":", 1)[1]))
    counter = 0

    def direct(max_tokens: int) -> Callable[[], Awaitable[None]]:
        async def send() -> None:
            nonlocal counter
            counter += 1
            request = pb.GenerateRequest(
                request_id=f"direct-{counter}",
                prompt_token_ids=prompt_ids,
                sampling=pb.SamplingParams(max_tokens=max_tokens),
            )
            async for message in stubs[counter % len(stubs)].Generate(request):
                if message.finish_reason:
                    return

        return send

    def gateway(max_tokens: int) -> Callable[[], Awaitable[None]]:
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens}).encode()

        async def send() -> None:
            status, _ = await http.post("/v1/chat/completions", body)
            if status != 200:
                raise RuntimeError(f"HTTP {status}")

        return send

    results: dict[str, Any] = {}
    # Warm up both paths (connections, tokenizer, hash memo, JIT-free but cache-warm).
    await closed_loop(direct(16), 8, 1.0)
    await closed_loop(gateway(16), 8, 1.0)
    latency = {}
    for arm, make in (("direct", direct), ("gateway", gateway)):
        latency[arm] = asdict(await open_loop(arm, make(16), args.rate, args.duration_s, seed=1))
    results["latency"] = latency
    results["added_ms"] = {
        q: latency["gateway"]["latency"][q] - latency["direct"]["latency"][q]
        for q in ("p50_ms", "p90_ms", "p99_ms")
    }
    results["throughput_closed_loop"] = {
        arm: await closed_loop(make(1), args.concurrency, args.throughput_s)
        for arm, make in (("direct", direct), ("gateway", gateway))
    }
    results["target_rate_check"] = asdict(
        await open_loop("gateway", gateway(1), args.target_rate, args.throughput_s, seed=2)
    )
    await http.close()
    for c in channels:
        await c.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description="Gateway overhead benchmark (docs/benchmarks.md).")
    p.add_argument("--quick", action="store_true", help="short runs, 4 stub workers")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workers", type=int, help="stub workers (default 16; 4 with --quick)")
    p.add_argument("--rate", type=float, default=100.0, help="req/s of the latency arms")
    p.add_argument("--target-rate", type=float, default=300.0, help="req/s to check")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    args = p.parse_args()
    args.workers = args.workers or (4 if args.quick else 16)
    args.duration_s = 8.0 if args.quick else 30.0
    args.throughput_s = 5.0 if args.quick else 15.0
    num_decisions = 300 if args.quick else 2000

    print(f"decision time: 8192-token prompts, 16 workers, {num_decisions} decisions", flush=True)
    decision = decision_benchmark(16, 8192, num_decisions)
    procs: list[subprocess.Popen[str]] = []
    try:
        addresses = []
        for _ in range(args.workers):
            proc, line = start([sys.executable, str(ROOT / "gateway_stub_worker.py"),
                                "--model", MODEL], "STUB_WORKER_READY")  # fmt: skip
            procs.append(proc)
            addresses.append(f"127.0.0.1:{line.split('port=')[1]}")
        proc, line = start([sys.executable, "-m", "kvflow.cli.main", "router", "--host",
                            "127.0.0.1", "--port", "0", "--served-model-name", MODEL,
                            "--workers", ",".join(addresses), "--log-level", "warning"],
                           "KVFLOW_ROUTER_READY")  # fmt: skip
        procs.append(proc)
        url = f"http://127.0.0.1:{line.split('port=')[1]}"
        wait_gateway(url, args.workers)
        print(f"{args.workers} stub workers and the gateway are up; measuring", flush=True)
        arms = asyncio.run(run_arms(url, addresses, args))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()

    report = {
        "benchmark": "gateway_overhead",
        "command": " ".join(sys.argv),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m_at_end": os.getloadavg()[0],
        },
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"json": str(args.json)},
        "decision": decision,
        **arms,
    }
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


def print_report(r: dict[str, Any]) -> None:
    d = r["decision"]
    print(
        f"\nrouting decision, {d['prompt_tokens']}-token prompts, {d['num_workers']} workers (ms)"
    )
    for kind in ("cached", "three_quarters_cached", "cold", "cached_without_hash_memo"):
        s = d[kind]
        print(f"  {kind:<26} p50 {s['p50_ms']:7.3f}  p99 {s['p99_ms']:7.3f}")
    print(f"\nlatency at {r['settings']['rate']:.0f} req/s, 16 output tokens (ms)")
    for arm in ("direct", "gateway"):
        a = r["latency"][arm]
        lat, delay = a["latency"], a["schedule_delay"]
        validity = "valid" if a["is_valid"] else "INVALID"
        print(f"  {arm:<8} p50 {lat['p50_ms']:7.2f}  p90 {lat['p90_ms']:7.2f}"
              f"  p99 {lat['p99_ms']:7.2f}  achieved {a['achieved_rate']:6.1f}/s"
              f"  sched-delay p99 {delay['p99_ms']:5.2f}  {validity}")  # fmt: skip
    added = r["added_ms"]
    print(f"  added by the gateway: p50 {added['p50_ms']:.2f}  p90 {added['p90_ms']:.2f}"
          f"  p99 {added['p99_ms']:.2f}")  # fmt: skip
    t = r["throughput_closed_loop"]
    print(f"\nthroughput, 1-token answers, {r['settings']['concurrency']} clients: "
          f"direct {t['direct']:.0f}/s, gateway {t['gateway']:.0f}/s "
          f"(ratio {t['gateway'] / t['direct']:.2f})")  # fmt: skip
    c = r["target_rate_check"]
    print(f"open loop at {c['target_rate']:.0f}/s through the gateway: achieved "
          f"{c['achieved_rate']:.1f}/s, p50 {c['latency']['p50_ms']:.2f} ms, "
          f"p99 {c['latency']['p99_ms']:.2f} ms, "
          f"{'valid' if c['is_valid'] else 'INVALID'}")  # fmt: skip


if __name__ == "__main__":
    main()
