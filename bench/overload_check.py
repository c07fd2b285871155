"""Overload, with and without shedding: open-loop arrivals at twice a simulated worker's
capacity, through a real gateway, once with admission control off (and an unbounded worker
queue) and once on. Prints, per arm, the answers by status and the latency of the requests
that were served.

    PYTHONPATH=tests .venv/bin/python bench/overload_check.py --rate 16 --duration-s 30

The worker runs 4 requests at once, 20 ms a step; a request of 25 tokens holds a slot for
0.5 s, so the worker serves 8 requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence

import httpx
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "20",
            "--max-num-seqs", "4", "--num-kv-blocks", "4096"]  # fmt: skip
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 25, "ignore_eos": True}  # fmt: skip


async def _one(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    started_s = time.monotonic()
    r = await client.post(f"{url}/v1/chat/completions", json=BODY)
    return r.status_code, time.monotonic() - started_s


async def _open_loop(
    url: str, rate_per_s: float, duration_s: float, seed: int
) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
        end_s = time.monotonic() + duration_s
        while time.monotonic() < end_s:
            tasks.append(asyncio.ensure_future(_one(client, url)))
            await asyncio.sleep(rng.expovariate(rate_per_s))
        return list(await asyncio.gather(*tasks))


def _arm(
    name: str, worker_args: Sequence[str], router_args: Sequence[str], args: argparse.Namespace
) -> None:
    worker = launch_worker([*SIM_ARGS, *worker_args])
    gateway = launch_gateway(
        ["--served-model-name", MODEL, "--workers", worker.address, *router_args]
    )
    try:
        gateway.wait_ready()
        results = asyncio.run(_open_loop(gateway.url, args.rate, args.duration_s, args.seed))
    finally:
        gateway.stop()
        worker.stop()
    statuses = Counter(status for status, _ in results)
    served = sorted(s for status, s in results if status == 200)
    q = statistics.quantiles(served, n=100) if len(served) > 1 else [0.0] * 99
    answers = ", ".join(f"{status}: {n}" for status, n in sorted(statuses.items()))
    worst_s = served[-1] if served else 0.0
    print(f"{name}: sent {len(results)}, {answers}; served e2e p50 {q[49]:.2f} s, "
          f"p99 {q[98]:.2f} s, max {worst_s:.2f} s")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=16.0, help="arrivals per second (Poisson)")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shed-queue-time-s", default="2.5")
    p.add_argument("--max-queue-time-s", default="5")
    args = p.parse_args()
    _arm("admission off, unbounded queue", ["--max-waiting-requests", "1000000"],
         ["--admission", "off"], args)  # fmt: skip
    _arm(f"admission on (shed {args.shed_queue_time_s} s, max {args.max_queue_time_s} s)", [],
         ["--admission-shed-queue-time-s", args.shed_queue_time_s,
          "--admission-max-queue-time-s", args.max_queue_time_s], args)  # fmt: skip


if __name__ == "__main__":
    main()
