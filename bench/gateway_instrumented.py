"""The real `kvflow router`, with wall-clock timers around the stages of a request, or with
one change tried out: a measuring tool for bench/gateway_overhead.py, not a product path.

    python bench/gateway_instrumented.py [--stage-times OUT.json] [--defer-settlement] \
        -- <kvflow router arguments>

``--stage-times``: each stage below is wrapped (the router's own functions, patched at
class or module level before the app is built), and on exit the per-request wall times
(P50/P90/P99/mean, milliseconds) go to OUT.json; SIGUSR1 drops the times so far (the
benchmark sends it when its warm-up ends). Async stages include their awaits, so
the quota stages show what a Redis round trip costs in latency, not only in CPU; time
outside ``handler`` (HTTP parsing, the middleware, routing in Starlette, writing the
response) is the client's latency minus it. The wrappers cost about 1 us each.

``--defer-settlement``: ``Accounting.finish`` (the quota lease's release and the usage
record: two Redis round trips with a tenant config and --redis-url) runs as a task after
the handler returns, so the response no longer waits for it: a what-if of a router change
(measured in docs/benchmarks.md: it did not pay).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvflow.router.api import app as app_module
from kvflow.router.api import completions, respond
from kvflow.router.api.accounting import Accounting
from kvflow.router.api.gateway import Gateway
from kvflow.router.cli import main as router_main
from kvflow.router.serving.executor import PlanExecutor
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.prompts import PromptBuilder
from kvflow.router.tenants.service import QuotaService

TIMES_MS: dict[str, list[float]] = {}


def _timed_async(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    times = TIMES_MS.setdefault(stage, [])

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - started) * 1e3)

    return wrapper


def _timed_sync(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wall time, and the thread's CPU time as ``<stage>_cpu``: a synchronous stage whose
    wall time exceeds its CPU time was preempted (or waited on the GIL) meanwhile."""
    times = TIMES_MS.setdefault(stage, [])
    cpu_times = TIMES_MS.setdefault(f"{stage}_cpu", [])

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append((time.perf_counter() - started) * 1e3)
            cpu_times.append((time.thread_time() - started_cpu) * 1e3)

    return wrapper


def install_gc_timer() -> None:
    """Every garbage collection's pause, as ``gc_pause`` (all) and ``gc_pause_gen2``."""
    pauses, full = TIMES_MS.setdefault("gc_pause", []), TIMES_MS.setdefault("gc_pause_gen2", [])
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        pause_ms = (time.perf_counter() - started[0]) * 1e3
        pauses.append(pause_ms)
        if info["generation"] == 2:
            full.append(pause_ms)

    gc.callbacks.append(on_gc)


def install_stage_timers() -> None:
    # Order of a non-streaming chat request; "collect" holds plan, worker call and
    # the JSON body; "handler" holds all of them.
    app_module.handle_completion = _timed_async("handler", app_module.handle_completion)  # type: ignore[assignment]
    Gateway.authenticate = _timed_sync("authenticate", Gateway.authenticate)  # type: ignore[method-assign]
    completions.read_json_body = _timed_async("read_body", completions.read_json_body)  # type: ignore[assignment]
    PromptBuilder.chat = _timed_sync("template_and_tokenize", PromptBuilder.chat)  # type: ignore[method-assign]
    QuotaService.admit = _timed_async("quota_admit", QuotaService.admit)  # type: ignore[method-assign]
    respond._collect = _timed_async("collect", respond._collect)  # type: ignore[assignment]
    GenerationService._plan = _timed_sync("routing_decision", GenerationService._plan)  # type: ignore[method-assign]
    PlanExecutor.run = _timed_async("worker_stream", PlanExecutor.run)  # type: ignore[method-assign]
    Accounting.finish = _timed_async("quota_settle", Accounting.finish)  # type: ignore[method-assign]
    install_gc_timer()
    install_size_probe()


SERVICES: list[GenerationService] = []


def install_size_probe() -> None:
    """Keep the generation service, to report what its bounded tables hold at exit."""
    init = GenerationService.__init__

    @functools.wraps(init)
    def keep(self: GenerationService, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        SERVICES.append(self)

    GenerationService.__init__ = keep  # type: ignore[method-assign]


def sizes() -> dict[str, float]:
    """The block-hash memo and the session table of the (only) generation service: entries,
    and the memo's bytes per entry measured on one entry (key tuple, its 64-byte chunk,
    the hash, and a dict slot of about 3 words)."""
    if not SERVICES:
        return {}
    service = SERVICES[0]
    hasher = service._hasher
    memo = hasher._hashes
    entry_bytes = 0.0
    if memo:
        key, value = next(iter(memo.items()))
        entry_bytes = (sys.getsizeof(key) + sum(sys.getsizeof(k) for k in key[-1:])
                       + sys.getsizeof(value) + 3 * 8)  # fmt: skip
    return {"memo_entries": len(memo), "memo_hits": hasher.num_hits,
            "memo_misses": hasher.num_misses, "memo_bytes_per_entry": entry_bytes,
            "sessions": len(service._sessions)}  # fmt: skip


def allocations(top: int = 12) -> dict[str, Any]:
    """What was allocated after tracing began and is still alive, by source line."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    lines = snapshot.statistics("lineno")
    return {
        "total_kib": sum(s.size for s in lines) / 1024,
        "top": [{"where": str(s.traceback), "kib": s.size / 1024, "count": s.count}
                for s in lines[:top]],
    }  # fmt: skip


def defer_settlement() -> None:
    settle = Accounting.finish
    pending: set[asyncio.Task[None]] = set()

    async def finish_later(self: Accounting) -> None:
        # The first call's task runs first and marks the accounting finished, so the
        # handler's repeated calls settle once, as before.
        task = asyncio.get_running_loop().create_task(settle(self))
        pending.add(task)
        task.add_done_callback(pending.discard)

    Accounting.finish = finish_later  # type: ignore[method-assign]


def summary(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    n = len(ordered)

    def q(p: float) -> float:
        return ordered[min(n - 1, int(p * n))]

    return {"n": n, "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": ordered[-1], "mean_ms": sum(ordered) / n}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage-times", type=Path, help="write per-stage wall times here on exit")
    p.add_argument("--defer-settlement", action="store_true")
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="with --stage-times: trace allocations from SIGUSR1 on, and write "
        "the lines holding the most of what is still allocated at exit",
    )
    p.add_argument("router_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    router_args = [a for a in args.router_args if a != "--"]
    if args.stage_times:
        install_stage_timers()
    if args.defer_settlement:
        defer_settlement()  # after the timers: the handler no longer waits for settling
    # uvicorn re-raises the SIGTERM it caught once the server has stopped; with Python's
    # default handler that kills the process before anything is written, so turn it into
    # an exit that runs the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    # SIGUSR1 forgets the times so far: the benchmark sends it when its warm-up ends.
    def measurement_starts(*_: object) -> None:
        for times in TIMES_MS.values():
            times.clear()
        if args.tracemalloc and not tracemalloc.is_tracing():
            tracemalloc.start()

    signal.signal(signal.SIGUSR1, measurement_starts)
    try:
        return router_main(router_args)
    finally:
        if args.stage_times:
            stats: dict[str, Any] = {stage: summary(t) for stage, t in TIMES_MS.items() if t}
            stats["sizes_at_exit"] = sizes()
            if tracemalloc.is_tracing():
                stats["allocations_alive_at_exit"] = allocations()
            args.stage_times.write_text(json.dumps(stats, indent=2))


if __name__ == "__main__":
    sys.exit(main())
