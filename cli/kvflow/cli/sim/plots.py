"""The comparison's PNG: TTFT P90 and prefix hit rate against QPS, one line per arm, one
row per workload. matplotlib on the Agg backend, imported only here."""

from __future__ import annotations

from pathlib import Path

from kvflow.cli.sim.compare import ComparisonResult


def plot_comparison(result: ComparisonResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in result.ladders))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.2 * len(workloads)), squeeze=False)
    slo_ms = result.config.slo.ttft_s * 1e3
    for row, workload in zip(axes, workloads, strict=True):
        ax_ttft, ax_hit = row
        for arm, points in result.by_workload(workload).items():
            qps = [p.qps for p in points]
            p90 = [(p.latency.ttft_p90_with_failures_s or float("nan")) * 1e3 for p in points]
            style = "-" if arm == "kvflow" else "--"
            ax_ttft.plot(qps, p90, style, marker="o", markersize=3, label=arm)
            ax_hit.plot(qps, [p.cache.hit_rate or 0 for p in points], style, marker="o",
                        markersize=3, label=arm)  # fmt: skip
        ax_ttft.axhline(slo_ms, color="red", alpha=0.4, label="SLO")
        ax_ttft.set(title=f"{workload}: TTFT P90", xlabel="QPS (req/s)", ylabel="ms",
                    yscale="log")  # fmt: skip
        ax_hit.set(title=f"{workload}: prefix hit rate", xlabel="QPS (req/s)", ylim=(0, 1))
        for ax in row:
            ax.grid(alpha=0.3)
        ax_ttft.legend(fontsize=7)
    fig.suptitle(f"routing comparison: {result.spec.num_workers} x {result.spec.profile.name}, "
                 "virtual time")  # fmt: skip
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
