"""Planner settings side by side: a table and a replicas-over-time plot from the JSON
reports of `python -m kvflow.sim.autoscale_cli` (virtual time, docs/benchmarks.md).

    python bench/planner_variants.py --static-peak step=9 --static-peak diurnal=12 \\
        "default=docs/bench-data/planner/scale20-landing.json" \\
        "window 60 s=docs/bench-data/planner/scale20-stab60.json" \\
        --plot docs/img/planner-variants.png --shape diurnal --startup 60

Each report's planner cells become rows (label, shape, start-up), with replica-hours
against static-peak's (given: the reports of planner-only runs carry no static arm) and
against the instant follower at that report's own margin (`follower_replica_hours`). The
plot draws each label's desired replicas over time (its decisions) for one shape and
start-up, and the follower's replicas at the default margin.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvflow.operator.planner import Tuning
from kvflow.sim.autoscale_bench import BenchConfig, shares


def _labelled(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for spec in specs:
        label, _, path = spec.rpartition("=")
        if not label:
            raise SystemExit(f"{spec!r}: write LABEL=PATH")
        out.append((label, json.loads(Path(path).read_text())))
    return out


def table(reports: list[tuple[str, dict[str, Any]]], static_peak: dict[str, float]) -> str:
    lines = [
        "| planner | traffic | start-up | SLO attainment | replica-hours | vs static-peak "
        "| vs instant follower | scale events/h | max replicas | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, report in reports:
        follower = report["follower_replica_hours"]
        for c in report["cells"]:
            if not c["arm"].startswith("planner"):
                continue
            shape, hours = c["shape"], c["replica_hours"]
            peak = static_peak.get(shape)
            vs_peak = f"{hours / peak:.2f}x" if peak else "-"
            lines.append(
                f"| {label} | {shape} | {c['startup_s']:.0f} s | {c['attainment']:.1%} "
                f"| {hours:.2f} | {vs_peak} | {hours / follower[shape]:.2f}x "
                f"| {c['scale_events_per_hour']:.1f} | {c['max_replicas']} "
                f"| {c['num_refused'] / c['num_requests']:.1%} |"
            )
    return "\n".join(lines)


def _follower(config: dict[str, Any], shape: str) -> tuple[list[float], list[int]]:
    """The instant follower's replicas every 10 s at the default margin."""
    bench = BenchConfig(peak_rate_per_s=config["peak_rate_per_s"],
                        durations_s=config["durations_s"])  # fmt: skip
    traffic, t = bench.traffic(shape), Tuning()
    times = [10.0 * i for i in range(int(traffic.duration_s // 10) + 1)]
    return [s / 60 for s in times], [
        max(1, t.replicas_for(shares(bench, traffic.rate_at(s)), t.target_utilization))
        for s in times
    ]


def plot(reports: list[tuple[str, dict[str, Any]]], shape: str, startup_s: float,
         path: str) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    minutes, follower = _follower(reports[0][1]["config"], shape)
    ax.plot(minutes, follower, color="grey", linestyle=":", label="instant follower (80 %)")
    for label, report in reports:
        for c in report["cells"]:
            if c["shape"] != shape or c["startup_s"] != startup_s:
                continue
            times = [d[0] / 60 for d in c["decisions"]]
            ax.step(times, [d[1] for d in c["decisions"]], where="post", label=label)
    ax.set(title=f"{shape}: desired replicas (start-up {startup_s:.0f} s)",
           xlabel="minutes", ylabel="replicas")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="LABEL=PATH of an autoscale_cli --json")
    parser.add_argument(
        "--static-peak",
        action="append",
        default=[],
        metavar="SHAPE=HOURS",
        help="static-peak's replica-hours on a shape (repeat per shape)",
    )
    parser.add_argument("--plot")
    parser.add_argument("--shape", default="diurnal")
    parser.add_argument("--startup", type=float, default=60.0)
    args = parser.parse_args(argv)
    static = {k: float(v) for k, _, v in (s.partition("=") for s in args.static_peak)}
    reports = _labelled(args.reports)
    print(table(reports, static))
    if args.plot:
        plot(reports, args.shape, args.startup, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
