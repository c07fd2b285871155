"""The comparison's report: a table per workload, the knees, the targets; JSON. Pure."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from kvflow.loadgen.report_json import point_dict
from kvflow.loadgen.summary import LoadPointSummary, knee
from kvflow.sim.compare import ComparisonResult, verdicts
from kvflow.sim.targets import Verdict

SCHEMA = "kvflow-sim-compare/1"


def _s(value: float | None) -> str:
    if value is None or math.isinf(value):
        return "inf"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
             for r in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def workload_table(workload: str, arms: dict[str, list[LoadPointSummary]]) -> str:
    names = list(arms)
    first = arms[names[0]]
    header = ["load", "QPS", *(f"{a} p90" for a in names)]
    rows = []
    for i, point in enumerate(first):
        cells = [point.label, f"{point.qps:.2f}"]
        cells += [_s(arms[a][i].latency.ttft_p90_with_failures_s) for a in names]
        rows.append(cells)
    parts = [f"{workload}: TTFT P90 (s; inf = more than 10 % failed)", _table(header, rows)]
    header = ["arm", "knee req/s", "TTFT p50 (s)", "TPOT p50 (ms)", "hit rate", "max/mean load"]
    rows = []
    for arm, points in arms.items():
        best = knee(points)
        rows.append([
            arm,
            "-" if best is None else f"{best.qps:.2f}",
            " ".join(_s(p.latency.ttft_s.p50) for p in points),
            " ".join(f"{(p.latency.tpot_s.p50 or 0) * 1e3:.0f}" for p in points),
            " ".join(f"{p.cache.hit_rate or 0:.2f}" for p in points),
            " ".join(f"{p.cache.load_imbalance or 0:.2f}" for p in points),
        ])  # fmt: skip
    parts += ["", "per rung, in ladder order:", _table(header, rows)]
    return "\n".join(parts)


def render(result: ComparisonResult) -> str:
    spec = result.spec
    parts = [
        f"cluster: {spec.num_workers} workers, profile {spec.profile.name} "
        f"({spec.engine_config().num_kv_blocks} KV blocks of {spec.profile.block_size} tokens "
        f"each), SLO TTFT {result.config.slo.ttft_s:g} s",
        "",
    ]
    for workload in dict.fromkeys(r.workload for r in result.ladders):
        parts += [workload_table(workload, result.by_workload(workload)), ""]
    parts.append("targets for the default router (kvflow):")
    for v in verdicts(result):
        mark = "info" if not v.is_target else "met " if v.is_met else "MISS"
        parts.append(f"  {mark} {v.name}: {v.value:.2f} (target {v.target}); {v.detail}")
    return "\n".join(parts)


def report_dict(result: ComparisonResult) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "config": asdict(result.config),
        "profile": asdict(result.spec.profile),
        "num_kv_blocks": result.spec.engine_config().num_kv_blocks,
        "ladders": [
            {
                "workload": r.workload,
                "arm": r.arm,
                "wall_s": r.wall_s,
                "floor_ttft_p90_s": r.floors_s,
                "load_points": [point_dict(p) for p in r.points],
                "knee": None if (k := knee(r.points)) is None else {"label": k.label, "qps": k.qps},
            }
            for r in result.ladders
        ],
        "targets": [verdict_dict(v) for v in verdicts(result)],
    }


def verdict_dict(verdict: Verdict) -> dict[str, object]:
    """A verdict as JSON: a value that is not a number (a target with no rung to judge)
    is null, since JSON has no NaN."""
    out = asdict(verdict)
    if math.isnan(verdict.value):
        out["value"] = None
    return out
