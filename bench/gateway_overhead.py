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
        [--paired-only --endpoints chat,responses]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from gateway_arms import ENDPOINTS, MESSAGES, direct_arm, run_gateway_arm, run_paired  # noqa: E402
from gateway_decision import decision_benchmark  # noqa: E402
from gateway_procs import GATEWAY_ARMS, MODEL, cpu_s, start, stop  # noqa: E402
from gateway_report import print_paired, print_report  # noqa: E402

from kvflow.router.text.model_files import load_text_model  # noqa: E402


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
    p.add_argument("--endpoints", default="chat",
                   help="the paired part's APIs, of chat,responses (the same request as a "
                   "chat completion or a Response; each a row)")  # fmt: skip
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
    endpoints = [e for e in args.endpoints.split(",") if e]
    if not endpoints or set(endpoints) - set(ENDPOINTS):
        p.error(f"--endpoints: a comma-separated list of {', '.join(ENDPOINTS)}")
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
                for endpoint in endpoints:
                    label = name if endpoint == "chat" else f"{name} /v1/responses"
                    paired[label] = run_paired(name, addresses, prompt_ids, args, workdir,
                                               endpoint)  # fmt: skip
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


if __name__ == "__main__":
    main()
