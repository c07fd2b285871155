"""The gateway benchmark's load: open-loop Poisson arrivals, a closed loop at a fixed
concurrency, and paired runs that time one request direct and through the gateway; and the
percentile summaries they report in (bench/gateway_overhead.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass
class LoadResult:
    arm: str
    target_rate: float
    achieved_rate: float
    latency: dict[str, float]
    schedule_delay: dict[str, float]
    num_errors: int
    is_valid: bool


async def poisson_arrivals(
    rng: random.Random,
    rate: float,
    duration_s: float,
    start: Callable[[float], Awaitable[None]],
) -> float:
    """Start ``start(scheduled)`` at Poisson arrivals of ``rate`` per second for
    ``duration_s``, each in a task of its own, and wait for them all; the seconds from the
    first schedule to the last one's end."""
    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    at = begin
    while at - begin < duration_s:
        at += rng.expovariate(rate)
        sleep_s = at - time.perf_counter()
        if sleep_s > 0:
            await asyncio.sleep(sleep_s)
        tasks.append(asyncio.create_task(start(at)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - begin


async def open_loop(
    arm: str, send: Callable[[], Awaitable[None]], rate: float, duration_s: float, seed: int
) -> LoadResult:
    """Poisson arrivals; each request's latency is measured from its scheduled time, so a
    late load generator shows up as latency and schedule delay, not as a lighter load."""
    rng = random.Random(seed)
    latencies: list[float] = []
    delays: list[float] = []
    errors = 0

    async def one(scheduled: float) -> None:
        nonlocal errors
        delays.append(time.perf_counter() - scheduled)
        try:
            await send()
        except Exception:  # a benchmark counts failures, whatever they are
            errors += 1
            return
        latencies.append(time.perf_counter() - scheduled)

    elapsed = await poisson_arrivals(rng, rate, duration_s, one)
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

    await poisson_arrivals(rng, rate, duration_s, lambda _scheduled: pair())
    return {
        "idle_added": summary_ms(idle),
        "loaded_rate_per_s": rate,
        "loaded_added": summary_ms(loaded),
        "loaded_direct": summary_ms(direct_s),
        "loaded_gateway": summary_ms(gateway_s),
        "loaded_errors": errors,
    }
