"""The planner benchmark's outputs: a markdown table, JSON, and a plot of replicas and
latency over time (matplotlib on the Agg backend, imported only in `plot`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow.sim.autoscale import RunResult, Slo
from kvflow.sim.autoscale_bench import BenchConfig, Cell
from kvflow.sim.autoscale_metrics import Score, buckets

Row = tuple[Cell, Score, RunResult]


def table(
    rows: Sequence[Row],
    follower_hours: dict[str, float] | None = None,
    ahead_hours: dict[str, dict[float, float]] | None = None,
) -> str:
    """One line per cell; replica-hours also as a ratio to static-peak on the same shape.

    `follower_hours`: per shape, the replica-hours of an instant follower at the planner's
    margin (`follower_replica_hours`), a line of its own after the shape's cells;
    `ahead_hours`: per shape and start-up, the same follower with that start-up, holding
    what the next start-up's load needs (a line each).
    """
    peak = {c.shape: s.replica_hours for c, s, _ in rows if c.arm == "static-peak"}
    lines = [
        "| traffic | arm | start-up | SLO attainment | replica-hours | vs static-peak "
        "| scale events/h | recovery | max replicas | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, s, _ in rows:
        startup = "-" if cell.arm.startswith("static") else f"{cell.startup_s:.0f} s"
        arm = f"{cell.arm} ({cell.static_replicas})" if cell.arm.startswith("static") else cell.arm
        ratio = f"{s.replica_hours / peak[cell.shape]:.2f}x" if peak.get(cell.shape) else "-"
        recovery = "-" if s.recovery_s is None else f"{s.recovery_s:.0f} s"
        lines.append(
            f"| {cell.shape} | {arm} | {startup} | {s.attainment:.1%} | {s.replica_hours:.2f} "
            f"| {ratio} | {s.scale_events_per_hour:.1f} | {recovery} | {s.max_replicas} "
            f"| {s.num_refused / s.num_requests if s.num_requests else 0:.1%} |"
        )
    bounds = [
        (shape, "instant follower (bound)", 0.0, h) for shape, h in (follower_hours or {}).items()
    ]
    for shape, by_startup in (ahead_hours or {}).items():
        bounds += [(shape, "follower, start-up ahead (bound)", s, h) for s, h in by_startup.items()]
    for shape, name, startup_s, hours in bounds:
        ratio = f"{hours / peak[shape]:.2f}x" if peak.get(shape) else "-"
        lines.append(
            f"| {shape} | {name} | {startup_s:.0f} s | - | {hours:.2f} | {ratio} | - | - | - | - |"
        )
    return "\n".join(lines)


def report_dict(
    config: BenchConfig,
    rows: Sequence[Row],
    follower_hours: dict[str, float] | None = None,
    ahead_hours: dict[str, dict[float, float]] | None = None,
) -> dict[str, Any]:
    return {
        "follower_replica_hours": follower_hours or {},
        # per shape, per start-up (seconds, as a string key): the follower with that start-up
        "follower_ahead_replica_hours": {
            shape: {f"{s:g}": h for s, h in by.items()} for shape, by in (ahead_hours or {}).items()
        },
        "config": {
            "profile": config.profile,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "slo": {"ttft_s": config.slo.ttft_s, "tpot_s": config.slo.tpot_s,
                    "percentile": config.slo.percentile},
            "input_tokens": config.input_tokens,
            "output_tokens": config.output_tokens,
            "peak_rate_per_s": config.peak_rate_per_s,
            "durations_s": config.durations_s,
            "capacity": {
                "max_prompt_tokens_per_s": config.capacity().max_prompt_tokens_per_s,
                "max_decode_tokens_per_s": config.capacity().max_decode_tokens_per_s,
            },
            "seed": config.seed,
            "admission_max_queue_s": config.admission_max_queue_s,
            "planner_interval_s": config.planner_interval_s,
            "utilization": config.utilization,
            "pooled_margin": config.pooled_margin,
            "stabilization_s": config.stabilization_s,
            "max_replicas": config.max_replicas,
        },
        "cells": [
            {
                "arm": c.arm,
                "shape": c.shape,
                "startup_s": c.startup_s,
                "static_replicas": c.static_replicas,
                "num_requests": s.num_requests,
                "attainment": s.attainment,
                "replica_hours": s.replica_hours,
                "scale_events_per_hour": s.scale_events_per_hour,
                "recovery_s": s.recovery_s,
                "max_replicas": s.max_replicas,
                "num_refused": s.num_refused,
                "decisions": [(d.time_s, d.replicas, d.reason) for d in r.decisions
                              if not c.arm.startswith("static")],
            }
            for c, s, r in rows
        ],
    }  # fmt: skip


def plot(rows: Sequence[Row], slo: Slo, path: str | Path, *, startup_s: float = 60.0) -> None:
    """Per traffic shape: replicas (desired) and TTFT P90 per 30 s over time, every arm at
    the given start-up delay (static arms have none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(c.shape for c, _, _ in rows))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(12, 3.2 * len(shapes)), squeeze=False)
    for (ax_n, ax_t), shape in zip(axes, shapes, strict=True):
        for cell, _, result in rows:
            if cell.shape != shape or (not cell.arm.startswith("static")
                                       and cell.startup_s != startup_s):  # fmt: skip
                continue
            minutes = [r.time_s / 60 for r in result.replicas]
            ax_n.step(minutes, [r.desired for r in result.replicas], where="post",
                      label=cell.arm)  # fmt: skip
            series = buckets(result.records, slo, result.traffic.duration_s)
            ax_t.plot([b.start_s / 60 for b in series],
                      [(b.ttft_p90_s or float("nan")) for b in series], label=cell.arm)  # fmt: skip
        ax_t.axhline(slo.ttft_s, color="red", alpha=0.4, label="TTFT target")
        ax_n.set(title=f"{shape}: replicas (start-up {startup_s:.0f} s)", xlabel="minutes")
        ax_t.set(title=f"{shape}: TTFT P90 per 30 s", xlabel="minutes", ylabel="s",
                 yscale="log")  # fmt: skip
        for ax in (ax_n, ax_t):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
