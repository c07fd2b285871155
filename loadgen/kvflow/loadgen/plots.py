"""PNG plots: TTFT, TPOT and throughput against QPS, one line per arm, SLOs marked.

An arm is one ladder (a router policy, a server); this session's `kvflow bench` has one,
the routing comparison several. matplotlib is imported here only, on the Agg backend (no
display), so a run without ``--plot`` does not need it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvflow.loadgen.metrics import Percentiles, Slo
from kvflow.loadgen.summary import LoadPointSummary, knee


def _ms(points: Sequence[LoadPointSummary], pick: str, field: str) -> list[float]:
    values = []
    for p in points:
        pcts: Percentiles = getattr(p.latency, pick)
        value = getattr(pcts, field)
        values.append(float("nan") if value is None else value * 1e3)
    return values


def plot_ladders(
    arms: Mapping[str, Sequence[LoadPointSummary]], slo: Slo, path: str | Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tpot, ax_tput) = plt.subplots(1, 3, figsize=(15, 4.5))
    for arm, points in arms.items():
        qps = [p.qps for p in points]
        for field, style in (("p50", ":"), ("p90", "-"), ("p99", "--")):
            ax_ttft.plot(qps, _ms(points, "ttft_s", field), style, marker="o",
                         label=f"{arm} {field}")  # fmt: skip
            ax_tpot.plot(qps, _ms(points, "tpot_s", field), style, marker="o",
                         label=f"{arm} {field}")  # fmt: skip
        ax_tput.plot(qps, [p.throughput.requests_per_s for p in points], "-", marker="o",
                     label=f"{arm} completed")  # fmt: skip
        ax_tput.plot(qps, [p.throughput.goodput_per_s for p in points], "--", marker="o",
                     label=f"{arm} goodput")  # fmt: skip
        best = knee(points)
        if best is not None:
            ax_ttft.axvline(best.qps, color="grey", alpha=0.4)
            ax_ttft.annotate(f"knee {arm} ", (best.qps, slo.ttft_s * 1e3), fontsize=8,
                             ha="right", va="bottom")  # fmt: skip
    ax_ttft.axhline(slo.ttft_s * 1e3, color="red", alpha=0.5, label="SLO")
    ax_tpot.axhline(slo.tpot_s * 1e3, color="red", alpha=0.5, label="SLO")
    ax_ttft.set(title="TTFT", xlabel="QPS (req/s)", ylabel="ms", yscale="log")
    ax_tpot.set(title="TPOT", xlabel="QPS (req/s)", ylabel="ms")
    ax_tput.set(title="throughput", xlabel="QPS (req/s)", ylabel="req/s")
    for ax in (ax_ttft, ax_tpot, ax_tput):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
