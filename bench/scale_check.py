"""Scale check: the real gateway in front of 64 simulated workers, in wall time, for 10 min.

Four processes host 16 simulated workers each (``kvflow.engine_worker.sim.host``: the real
engine per worker, its own gRPC port, the step time of a profile slept on its thread); the
gateway (``kvflow router``) probes every one of them, follows their KV events and routes
open-loop Poisson traffic of shared-prefix groups (``kvflow bench``'s workload: groups of
users sharing a system prompt, a new question each request, a session id per user). Every
``--sample-s`` the script reads the gateway's /metrics (its routing-decision histogram and
the size of its KV index), its RSS and CPU from /proc, and every worker's cached block
count over gRPC, and reports:

  decision time  P50/P99 of ``kvflow_router_routing_decision_seconds`` over the run after
                 warm-up (the router's own timer around placement; bounds checked exactly,
                 values interpolated in their bucket: bench/scale_metrics.py), per window too
  KV index       distinct block hashes over time, against the workers' own cached blocks and
                 their total capacity (the KV caches are kept small, so eviction starts
                 within the first minute or two and the index has to track removals)
  memory         the gateway's RSS over time, and its trend over the second half

Targets (issue 8): decision P50 < 1 ms and P99 < 5 ms; index bounded; RSS flat.

    python bench/scale_check.py [--quick] [--json PATH]      # 10 min (quick: 1 min)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from gateway_http import HttpClient, wait_ready  # noqa: E402
from scale_metrics import INDEX_METRIC, Histogram, parse_gauge, parse_histogram  # noqa: E402
from scale_report import print_report, summarize  # noqa: E402

from kvflow.loadgen.payloads import EndpointConfig, request_body  # noqa: E402
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload  # noqa: E402
from kvflow.proto import worker_pb2 as pb  # noqa: E402
from kvflow.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "sim-llama3-8b"
BLOCK_SIZE = 16
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


# -- processes ------------------------------------------------------------------------------


def start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def ready_line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 180) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"{proc.args} did not print {prefix}")


def wait_healthy(url: str, num_workers: int) -> None:
    wait_ready(url, num_workers, timeout_s=120, poll_s=0.5)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE_KIB / 1024


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


# -- traffic and sampling -------------------------------------------------------------------


@dataclass
class Sample:
    t_s: float  # since the traffic began; negative: none
    is_warmup: bool
    num_requests_done: int
    num_blocks_stored: int  # about, since the start
    decision_p50_ms: float  # in the window since the previous sample
    decision_p99_ms: float
    num_decisions: float
    index_blocks: float
    worker_cached_blocks: int
    gateway_rss_mib: float
    gateway_cpu_pct: float
    hosts_rss_mib: float


@dataclass
class Traffic:
    latencies_s: list[float]
    delays_s: list[float]
    errors: dict[str, int]
    num_sent: int = 0
    num_measured_sent: int = 0  # scheduled after the warm-up
    num_blocks_stored: int = 0  # about: new full blocks of the answered requests
    num_done: int = 0


def fetch_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text: str = r.read().decode()
        return text


async def drive(url: str, addresses: list[str], pids: dict[str, Any], args: argparse.Namespace
                ) -> dict[str, Any]:  # fmt: skip
    workload = SharedPrefixWorkload(num_groups=args.groups, users_per_group=args.users,
                                    question_words=args.question_words,
                                    output_tokens=args.output_tokens)  # fmt: skip
    endpoint = EndpointConfig(base_url=f"{url}/v1", model=MODEL)
    requests = workload.requests(seed=args.seed, namespace="scale")
    port = int(url.rsplit(":", 1)[1])
    http = HttpClient("127.0.0.1", port)
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pb_grpc.WorkerStub(c) for c in channels]
    traffic = Traffic([], [], {})
    rng = random.Random(args.seed)
    total_s = args.warmup_s + args.duration_s
    begin = time.perf_counter()

    async def one(scheduled: float, body: bytes, session: str) -> None:
        traffic.delays_s.append(time.perf_counter() - scheduled)
        try:
            status, payload = await http.post(
                "/v1/chat/completions", body, {"x-session-id": session}
            )
        except OSError as exc:
            traffic.errors[type(exc).__name__] = traffic.errors.get(type(exc).__name__, 0) + 1
            return
        if status != 200:
            traffic.errors[f"HTTP {status}"] = traffic.errors.get(f"HTTP {status}", 0) + 1
            return
        traffic.num_done += 1
        # Blocks the serving worker computed and stored (its cache had the rest): what the
        # index must absorb, and, once caches are full, drop again on REMOVED events.
        usage = json.loads(payload)["usage"]
        num_tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        traffic.num_blocks_stored += num_tokens // BLOCK_SIZE - cached // BLOCK_SIZE
        if scheduled - begin >= args.warmup_s:
            traffic.latencies_s.append(time.perf_counter() - scheduled)

    async def generate() -> None:
        tasks: set[asyncio.Task[None]] = set()
        at = begin
        while True:
            at += rng.expovariate(args.rate)
            if at - begin >= total_s:
                break
            request = next(requests)
            body = request_body(endpoint, request)
            body["stream"] = False  # the minimal client reads Content-Length bodies
            del body["stream_options"]
            encoded = json.dumps(body, separators=(",", ":")).encode()
            sleep_s = at - time.perf_counter()
            if sleep_s > 0:
                await asyncio.sleep(sleep_s)
            task = asyncio.create_task(one(at, encoded, request.session_id or "none"))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            traffic.num_sent += 1
            traffic.num_measured_sent += at - begin >= args.warmup_s
        await asyncio.gather(*tasks)

    samples: list[Sample] = []
    histograms: dict[str, Histogram] = {}
    last_cpu = [cpu_s(pids["gateway"]), time.perf_counter()]

    async def sample(previous: Histogram | None, previous_cpu: tuple[float, float]
                     ) -> tuple[Histogram, tuple[float, float]]:  # fmt: skip
        text = await asyncio.to_thread(fetch_metrics, url)
        hist = parse_histogram(text)
        window = hist.minus(previous) if previous is not None else hist
        loads = await asyncio.gather(*(s.Load(pb.LoadRequest(), timeout=10) for s in stubs))
        now = time.perf_counter()
        cpu = cpu_s(pids["gateway"])
        t_s = now - begin
        samples.append(Sample(
            t_s=round(t_s, 1),
            is_warmup=t_s < args.warmup_s - 0.01,
            num_requests_done=traffic.num_done,
            num_blocks_stored=traffic.num_blocks_stored,
            decision_p50_ms=window.quantile_s(0.5) * 1e3,
            decision_p99_ms=window.quantile_s(0.99) * 1e3,
            num_decisions=window.count,
            index_blocks=parse_gauge(text, INDEX_METRIC),
            worker_cached_blocks=sum(x.num_cached_blocks for x in loads),
            gateway_rss_mib=round(rss_mib(pids["gateway"]), 1),
            gateway_cpu_pct=round(100 * (cpu - previous_cpu[0]) / (now - previous_cpu[1]), 1),
            hosts_rss_mib=round(sum(rss_mib(p) for p in pids["hosts"]), 1),
        ))  # fmt: skip
        s = samples[-1]
        print(f"  t={s.t_s:6.1f}s{' (warm-up)' if s.is_warmup else '          '} done "
              f"{s.num_requests_done:6d}  decision p50 {s.decision_p50_ms:6.3f} ms p99 "
              f"{s.decision_p99_ms:6.3f} ms  index {s.index_blocks:7.0f} blocks (workers "
              f"{s.worker_cached_blocks:7d})  gateway RSS {s.gateway_rss_mib:6.1f} MiB "
              f"CPU {s.gateway_cpu_pct:5.1f} %", flush=True)  # fmt: skip
        return hist, (cpu, now)

    async def sampler() -> None:
        # One sample at the start, one as warm-up ends, then every --sample-s.
        hist, cpu = await sample(None, (last_cpu[0], last_cpu[1]))
        histograms["last"] = hist
        for k in itertools.count():
            at_s = args.warmup_s + k * args.sample_s
            await asyncio.sleep(max(0.0, begin + at_s - time.perf_counter()))
            hist, cpu = await sample(hist, cpu)
            if "after_warmup" not in histograms:
                histograms["after_warmup"] = hist
                if args.instrumented:
                    os.kill(pids["gateway"], signal.SIGUSR1)  # forget the warm-up's stages
            histograms["last"] = hist
            last_cpu[:] = cpu

    sampling = asyncio.create_task(sampler())
    await generate()
    elapsed_s = time.perf_counter() - begin
    sampling.cancel()
    await asyncio.gather(sampling, return_exceptions=True)
    hist, _ = await sample(histograms["last"], (last_cpu[0], last_cpu[1]))
    await http.close()
    for c in channels:
        await c.close()
    measured = hist.minus(histograms["after_warmup"])
    return {"samples": [asdict(s) for s in samples], "measured_histogram": asdict(measured),
            "traffic": traffic, "elapsed_s": elapsed_s}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description="Scale check of the gateway (docs/benchmarks.md).")
    p.add_argument("--quick", action="store_true", help="1 minute instead of 10")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--hosts", type=int, default=4, help="processes the workers share")
    p.add_argument("--profile", default="h100-llama3-8b", help="simulated workers' profile")
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=256,
        help="KV blocks per worker: small, so caches evict within minutes",
    )
    p.add_argument("--rate", type=float, default=30.0, help="req/s, Poisson")
    p.add_argument("--groups", type=int, default=128, help="shared-prefix groups (llm-d: 150)")
    p.add_argument("--users", type=int, default=4, help="users (sessions) per group")
    p.add_argument("--question-words", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--duration-s", type=float, help="measured time (600; quick 60)")
    p.add_argument("--warmup-s", type=float, help="traffic before measuring (30; quick 10)")
    p.add_argument("--sample-s", type=float, help="seconds between samples (20; quick 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--instrumented",
        action="store_true",
        help="run the gateway under bench/gateway_instrumented.py: the decision's "
        "CPU time next to its wall time, and GC pauses",
    )
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="with --instrumented: what the gateway allocated after the warm-up "
        "and still holds at the end, by source line (slows the gateway)",
    )
    args = p.parse_args()  # fmt: skip
    args.duration_s = args.duration_s or (60.0 if args.quick else 600.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (10.0 if args.quick else 30.0)
    args.sample_s = args.sample_s or (5.0 if args.quick else 20.0)
    assert args.workers % args.hosts == 0, "--workers must be a multiple of --hosts"

    procs: list[subprocess.Popen[str]] = []
    stage_times: Path | None = None
    load_before = os.getloadavg()
    try:
        hosts = [start([sys.executable, "-m", "kvflow.engine_worker.sim.host", "--num-workers",
                        str(args.workers // args.hosts), "--port", "0",
                        "--served-model-name", MODEL, "--sim-profile", args.profile,
                        "--num-kv-blocks", str(args.num_kv_blocks)])
                 for _ in range(args.hosts)]  # fmt: skip
        procs += hosts
        addresses = [
            f"127.0.0.1:{port}"
            for h in hosts
            for port in ready_line(h, "KVFLOW_SIM_HOST_READY").split("=")[1].split(",")
        ]
        router_args = ["--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL,
                       "--workers", ",".join(addresses), "--log-level", "warning",
                       "--seed", str(args.seed)]  # fmt: skip
        if args.instrumented:
            stage_times = Path(tempfile.mkdtemp(prefix="kvflow-scale-")) / "stages.json"
            trace = ["--tracemalloc"] if args.tracemalloc else []
            gateway = start([sys.executable, str(ROOT / "gateway_instrumented.py"),
                             "--stage-times", str(stage_times), *trace, "--",
                             *router_args])  # fmt: skip
        else:
            gateway = start([sys.executable, "-m", "kvflow.cli.main", "router", *router_args])
        procs.append(gateway)
        url = f"http://127.0.0.1:{ready_line(gateway, 'KVFLOW_ROUTER_READY').split('port=')[1]}"
        wait_healthy(url, args.workers)
        print(f"{args.workers} simulated workers ({args.profile}, {args.num_kv_blocks} KV blocks "
              f"each) on {args.hosts} hosts and the gateway are up; {args.rate:.0f} req/s",
              flush=True)  # fmt: skip
        pids = {"gateway": gateway.pid, "hosts": [h.pid for h in hosts]}
        run = asyncio.run(drive(url, addresses, pids, args))
        if gateway.poll() is not None:
            raise RuntimeError(f"the gateway exited ({gateway.returncode}) during the run")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    if stage_times is not None:
        run["stages"] = json.loads(stage_times.read_text())
    summary = summarize(run, args)
    print_report(summary, args)
    report = {
        "benchmark": "scale_check",
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "elapsed_s": run["elapsed_s"],
        **summary,
        "samples": run["samples"],
    }  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
