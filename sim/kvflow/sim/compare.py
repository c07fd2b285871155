"""The routing comparison (issue 8; docs/benchmarks.md): every arm on every workload.

One invocation, one seed, one cluster spec (8 workers, the same profile and KV size for
every arm). Workloads:

- ``shared-prefix``: llm-d's shape (a 6,000-token system prompt per group, 1,200-token
  questions) with 300 groups of 5 users, so the prefixes (1.8 M tokens) are 4.4x one
  H100's KV for Llama-3-8B (411 k tokens) and half the cluster's; 100 output tokens (llm-d
  asks 1,000: the simulator pays per decoded token, and decode is not what routing
  changes). A Poisson ladder, each rung 1,200 warm-up requests (4 per group: 98 % of the
  groups seen, so the measured P90 is the steady state, not the first sight of a group)
  then 600 measured.
- ``hot-prefix``: the same shape with 8 groups of 20 users: each prefix carries an eighth
  of the traffic, a worker's worth, so a router that follows prefixes alone piles a hot
  one onto one worker (the robustness check of the default's load gate).
- ``mooncake``: the Mooncake FAST'25 synthetic trace, full lengths, at 1x, 2x, 4x speed,
  its first 60 s (divided by the speed-up) unmeasured.
- ``no-reuse``: 7,200-token prompts of fresh text and 100 output tokens; nothing to warm,
  so 100 warm-up requests then 400 measured.
- the generated trace families (``trace_families.FAMILIES``: ``conv-7k``,
  ``conv-7k-turns``, ``conv-2k-turns``, ``agent``): conversations with a shared system
  prompt and growing histories, and agents with long shared tool preambles, each 1,000
  requests (500 with ``--quick``) at 1x, 2x, 4x, their first 30 s / speed unmeasured.

``--quick`` keeps the shapes and cuts the rungs and requests (a few minutes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.no_reuse import NoReuseWorkload
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.loadgen.summary import LoadPointSummary
from kvflow.loadgen.trace import load_trace
from kvflow.loadgen.trace_replay import TraceWorkload
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec, WorkerStats
from kvflow.sim.ladders import SimLadder, run_ladder
from kvflow.sim.pool import process_pool
from kvflow.sim.targets import (
    Verdict,
    balance_target,
    family_targets,
    hit_rate_target,
    knee_target,
    parity_target,
    ttft_targets,
)
from kvflow.sim.trace_families import FAMILIES, family

ARMS = ("kvflow", "round-robin", "least-loaded", "random", "session", "ideal", "kvflow:gate=off")
SHARED_PREFIX_RATES: tuple[float, ...] = (10, 20, 30, 40, 50, 60, 70, 80, 90)
HOT_PREFIX_RATES: tuple[float, ...] = (20, 40, 60)
NO_REUSE_RATES: tuple[float, ...] = (5, 10, 15, 20, 25, 30)
TRACE_SPEEDUPS: tuple[float, ...] = (1, 2, 4)
# A generated family's trace under --quick (the full one has 1,000 requests), and the
# schedule left unmeasured at 1x (divided by the speed-up): the first sessions' turns.
QUICK_FAMILY_REQUESTS = 500
FAMILY_WARMUP_S = 30.0


@dataclass(frozen=True)
class ComparisonConfig:
    trace_path: str
    profile: str = "h100-llama3-8b"
    num_workers: int = 8
    num_kv_blocks: int | None = None
    arms: Sequence[str] = ARMS
    workloads: Sequence[str] = ("shared-prefix", "mooncake", "no-reuse", "hot-prefix")
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=1.0, tpot_s=0.1))
    seed: int = 0
    quick: bool = False
    jobs: int = 1


def ladders(config: ComparisonConfig) -> list[SimLadder]:
    quick = config.quick

    def poisson(rates: Sequence[float]) -> list[LoadPoint]:
        return [LoadPoint(ArrivalKind.POISSON, r) for r in rates]

    n = 200 if quick else 600
    out: list[SimLadder] = []
    for name in config.workloads:
        if name == "shared-prefix":
            workload = SharedPrefixWorkload(300, 5, (6000,), 1200, 100)
            rates: Sequence[float] = (10, 40, 70) if quick else SHARED_PREFIX_RATES
            out.append(SimLadder(name, workload, poisson(rates), config.slo, config.seed,
                                 warmup_requests=2 * n, measured_requests=n))  # fmt: skip
        elif name == "hot-prefix":
            workload = SharedPrefixWorkload(8, 20, (6000,), 1200, 100)
            rates = (20, 60) if quick else HOT_PREFIX_RATES
            out.append(SimLadder(name, workload, poisson(rates), config.slo, config.seed,
                                 warmup_requests=n // 3, measured_requests=n))  # fmt: skip
        elif name == "no-reuse":
            rates = (10, 25) if quick else NO_REUSE_RATES
            out.append(SimLadder(name, NoReuseWorkload(7200, 100), poisson(rates), config.slo,
                                 config.seed, warmup_requests=n // 6,
                                 measured_requests=2 * n // 3))  # fmt: skip
        elif name in FAMILIES:
            records = family(name, num_requests=QUICK_FAMILY_REQUESTS if quick else None,
                             seed=config.seed)  # fmt: skip
            speeds = [LoadPoint(ArrivalKind.TRACE, s) for s in TRACE_SPEEDUPS]
            out.append(SimLadder(name, TraceWorkload(records, name=name), speeds, config.slo,
                                 config.seed, trace_warmup_s=FAMILY_WARMUP_S))  # fmt: skip
        elif name == "mooncake":
            records = load_trace(config.trace_path)
            if quick:
                records = records[:1000]
            speeds = [LoadPoint(ArrivalKind.TRACE, s) for s in TRACE_SPEEDUPS]
            out.append(SimLadder(name, TraceWorkload(records), speeds, config.slo, config.seed))
        else:
            raise ValueError(
                f"unknown workload {name!r}: shared-prefix, mooncake, no-reuse, hot-prefix "
                f"or a trace family ({', '.join(FAMILIES)})"
            )
    return out


@dataclass
class ArmLadder:
    workload: str
    arm: str
    points: list[LoadPointSummary]
    workers: list[list[WorkerStats]]
    wall_s: float
    # Per rung, the measured requests' TTFT floors' P90 (floor.py; the same for every arm;
    # None where the report predates it).
    floors_s: list[float | None] = field(default_factory=list)


@dataclass
class ComparisonResult:
    config: ComparisonConfig
    spec: ClusterSpec
    ladders: list[ArmLadder] = field(default_factory=list)

    def by_workload(self, workload: str) -> dict[str, list[LoadPointSummary]]:
        return {r.arm: r.points for r in self.ladders if r.workload == workload}

    def floors_s(self, workload: str) -> list[float | None]:
        """Per rung, the TTFT floor's P90 (any arm's: they share their requests)."""
        for r in self.ladders:
            if r.workload == workload and r.floors_s:
                return r.floors_s
        return []


def _run_one(spec: ClusterSpec, arm_name: str, ladder: SimLadder) -> ArmLadder:
    started_s = time.perf_counter()
    results = run_ladder(spec, resolve_arm(arm_name), ladder)
    return ArmLadder(ladder.name, arm_name, [r.summary for r in results],
                     [r.workers for r in results], time.perf_counter() - started_s,
                     [r.floor_ttft_p90_s for r in results])  # fmt: skip


def run_comparison(
    config: ComparisonConfig, spec: ClusterSpec, on_done: Callable[[ArmLadder], None] | None = None
) -> ComparisonResult:
    """Every (workload, arm) ladder; ``jobs`` processes side by side (each is
    deterministic on its own, so the result does not depend on ``jobs``)."""
    jobs = [(spec, arm, ladder) for ladder in ladders(config) for arm in config.arms]
    result = ComparisonResult(config, spec)
    if config.jobs <= 1:
        done = (_run_one(*job) for job in jobs)
        for item in done:
            result.ladders.append(item)
            if on_done is not None:
                on_done(item)
        return result
    with process_pool(config.jobs) as pool:
        futures = [pool.submit(_run_one, *job) for job in jobs]
        for future in futures:
            item = future.result()
            result.ladders.append(item)
            if on_done is not None:
                on_done(item)
    return result


def verdicts(result: ComparisonResult) -> list[Verdict]:
    """The issue's targets for the default router, on the workloads that were run."""
    slo = result.config.slo
    out: list[Verdict] = []
    sp = result.by_workload("shared-prefix")
    if {"kvflow", "round-robin", "least-loaded"} <= set(sp):
        out.append(knee_target(sp, ["round-robin", "least-loaded"]))
        out += ttft_targets(sp, "round-robin", slo)
    for workload in ("shared-prefix", "mooncake", "hot-prefix", *FAMILIES):
        ladders_ = result.by_workload(workload)
        if {"kvflow", "ideal"} <= set(ladders_):
            out.append(hit_rate_target(workload, ladders_, slo))
    # Issue 39 asks its targets of every workload, the generated families and the four
    # fixed ones alike.
    for workload in (*FAMILIES, "mooncake", "shared-prefix", "no-reuse", "hot-prefix"):
        ladders_ = result.by_workload(workload)
        if {"kvflow", "least-loaded"} <= set(ladders_):
            out += family_targets(workload, ladders_, slo, result.floors_s(workload))
    for workload in ("shared-prefix", "mooncake", "no-reuse", "hot-prefix", *FAMILIES):
        ladders_ = result.by_workload(workload)
        if "kvflow" in ladders_:
            out.append(balance_target(workload, ladders_))
    nr = result.by_workload("no-reuse")
    if {"kvflow", "least-loaded"} <= set(nr):
        out.append(parity_target(nr, slo))
    mc = result.by_workload("mooncake")
    if {"kvflow", "round-robin"} <= set(mc):
        ours, theirs = mc["kvflow"], mc["round-robin"]
        for o, t in zip(ours, theirs, strict=True):
            p_o, p_t = o.latency.ttft_s.p90 or 0.0, t.latency.ttft_s.p90 or 0.0
            ratio = p_t / p_o if p_o else math.nan
            out.append(Verdict(f"mooncake {o.label}: round-robin's TTFT P90 over ours",
                               ratio >= 1.0, ratio, "(no target)",
                               f"{p_t:.3f} s vs {p_o:.3f} s", is_target=False))  # fmt: skip
    return out
