"""The comparison's PNG: TTFT P90 and prefix hit rate against QPS, one line per arm, one
row per workload. matplotlib on the Agg backend, imported only here.

Drawn from the JSON form of reports (`report.report_dict`), so one plot can merge several
runs' files: a re-run of one arm after a routing change joins the baselines' earlier run
(every ladder is deterministic per seed) instead of re-running them all."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvflow.sim.compare import ComparisonResult
from kvflow.sim.report import report_dict


class PlotError(ValueError):
    """Reports that cannot share one plot."""


def plot_comparison(result: ComparisonResult, path: str | Path) -> None:
    plot_reports([report_dict(result)], path)


def load_reports(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlotError(f"{path}: {exc}") from None
        if not isinstance(report, dict) or "ladders" not in report or "config" not in report:
            raise PlotError(f"{path}: not a `kvflow sim compare --json` report")
        reports.append(report)
    return reports


def merged_ladders(reports: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[Any]]]:
    """workload -> arm -> load points; a later report's ladder replaces an earlier one's.
    The reports must describe the same cluster and SLO, or their lines do not compare."""
    if not reports:
        raise PlotError("no reports to plot")
    keys = ("profile", "num_workers", "num_kv_blocks", "slo", "seed", "quick")
    first = {k: reports[0]["config"].get(k) for k in keys}
    merged: dict[str, dict[str, list[Any]]] = {}
    for report in reports:
        config = {k: report["config"].get(k) for k in keys}
        if config != first:
            raise PlotError(
                f"reports from different setups cannot share a plot: {first} vs {config}"
            )
        for ladder in report["ladders"]:
            merged.setdefault(ladder["workload"], {})[ladder["arm"]] = ladder["load_points"]
    return merged


def plot_reports(reports: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladders = merged_ladders(reports)
    config = reports[0]["config"]
    slo_ms = config["slo"]["ttft_s"] * 1e3
    fig, axes = plt.subplots(len(ladders), 2, figsize=(11, 3.2 * len(ladders)), squeeze=False)
    for row, (workload, arms) in zip(axes, ladders.items(), strict=True):
        ax_ttft, ax_hit = row
        for arm, points in arms.items():
            qps = [p["qps"] for p in points]
            p90 = [(p["latency"]["ttft_p90_with_failures_s"] or float("nan")) * 1e3 for p in points]
            style = "-" if arm == "kvflow" else "--"
            ax_ttft.plot(qps, p90, style, marker="o", markersize=3, label=arm)
            ax_hit.plot(qps, [p["cache"]["hit_rate"] or 0 for p in points], style, marker="o",
                        markersize=3, label=arm)  # fmt: skip
        ax_ttft.axhline(slo_ms, color="red", alpha=0.4, label="SLO")
        ax_ttft.set(title=f"{workload}: TTFT P90", xlabel="QPS (req/s)", ylabel="ms",
                    yscale="log")  # fmt: skip
        ax_hit.set(title=f"{workload}: prefix hit rate", xlabel="QPS (req/s)", ylim=(0, 1))
        for ax in row:
            ax.grid(alpha=0.3)
        ax_ttft.legend(fontsize=7)
    fig.suptitle(f"routing comparison: {config['num_workers']} x {config['profile']}, "
                 "virtual time")  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
