"""The terminal report: one row per load point, latencies in ms, then the knee. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.loadgen.metrics import Percentiles, Slo
from kvflow.loadgen.summary import LoadPointSummary, knee


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _pcts_ms(p: Percentiles) -> list[str]:
    return [_ms(p.p50), _ms(p.p90), _ms(p.p99)]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def latency_table(points: Sequence[LoadPointSummary]) -> str:
    header = ["load", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99",
              "ITL p50", "p99", "E2E p50", "p99"]  # fmt: skip
    rows = [
        [
            p.label,
            *_pcts_ms(p.latency.ttft_s),
            *_pcts_ms(p.latency.tpot_s),
            _ms(p.latency.itl_s.p50),
            _ms(p.latency.itl_s.p99),
            _ms(p.latency.e2e_s.p50),
            _ms(p.latency.e2e_s.p99),
        ]
        for p in points
    ]
    return "latency (ms)\n" + _table(header, rows)


def throughput_table(points: Sequence[LoadPointSummary]) -> str:
    header = ["load", "sched/s", "sent/s", "lag p99 ms", "ok", "errors", "req/s", "out tok/s",
              "goodput/s", "in SLO", "cache hit", "valid"]  # fmt: skip
    rows = []
    for p in points:
        t, s = p.throughput, p.schedule
        errors = sum(t.errors.values())
        rows.append(
            [
                p.label,
                _rate(s.scheduled_rate_per_s),
                _rate(s.achieved_rate_per_s),
                _ms(s.lag_s.p99),
                str(t.num_ok),
                str(errors),
                _rate(t.requests_per_s),
                f"{t.output_tokens_per_s:.1f}",
                _rate(t.goodput_per_s),
                _fraction(t.slo_attainment),
                _fraction(p.cache.hit_rate),
                "yes" if s.is_valid else "NO",
            ]
        )
    return "throughput\n" + _table(header, rows)


def render_report(points: Sequence[LoadPointSummary], slo: Slo) -> str:
    parts = [latency_table(points), "", throughput_table(points), ""]
    for p in points:
        for problem in p.schedule.problems:
            parts.append(f"INVALID {p.label}: {problem}")
        for kind, count in p.throughput.errors.items():
            parts.append(f"errors {p.label}: {count} x {kind}: {p.throughput.error_examples[kind]}")
        if p.cache.load_imbalance is not None:
            workers = ", ".join(f"{w}={n}" for w, n in p.cache.requests_per_worker.items())
            router = _fraction(p.cache.router_hit_rate)
            parts.append(
                f"workers {p.label}: max/mean {p.cache.load_imbalance:.2f} ({workers}); "
                f"router-predicted hit rate {router}"
            )
    best = knee(points)
    slo_text = f"TTFT P90 <= {slo.ttft_s * 1e3:g} ms"
    if best is None:
        parts.append(f"knee: no load point met {slo_text}")
    else:
        parts.append(f"knee: {best.label} ({best.qps:.2f} req/s) is the highest meeting {slo_text}")
    parts.append(
        f"goodput counts requests with TTFT <= {slo.ttft_s * 1e3:g} ms and "
        f"TPOT <= {slo.tpot_s * 1e3:g} ms"
    )
    return "\n".join(parts)
