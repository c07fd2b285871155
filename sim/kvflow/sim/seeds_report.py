"""The report of a comparison over several seeds: per workload a table of every rung and
arm (mean and range over seeds), then every target on its per-seed values; JSON. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvflow.sim.compare import ComparisonResult
from kvflow.sim.report import _table, report_dict
from kvflow.sim.seeds import RungSpread, SeedVerdict, Spread, results_verdicts, rung_spreads

SCHEMA = "kvflow-sim-compare-seeds/1"

Runs = Sequence[tuple[int, ComparisonResult]]


def _n(value: float, scale: float = 1.0, digits: int = 3) -> str:
    if math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value * scale:.{digits}f}"


def _cell(s: Spread, scale: float = 1.0, digits: int = 3) -> str:
    if s.num_values <= 1 or s.min == s.max:
        return _n(s.mean, scale, digits)
    return f"{_n(s.mean, scale, digits)} ({_n(s.min, scale, digits)}-{_n(s.max, scale, digits)})"


def _workload_table(workload: str, rungs: Sequence[RungSpread]) -> str:
    header = ["load", "arm", "TTFT p90 (s)", "TTFT p50 (s)", "TPOT p50 (ms)", "hit rate",
              "max/mean load", "seeds"]  # fmt: skip
    rows = []
    for r in sorted(rungs, key=lambda r: r.qps):  # stable: arms stay in run order per rung
        m = r.metrics
        rows.append([r.label, r.arm, _cell(m["ttft_p90_s"]), _cell(m["ttft_p50_s"]),
                     _cell(m["tpot_p50_s"], 1e3, 1), _cell(m["hit_rate"], digits=2),
                     _cell(m["load_imbalance"], digits=2), str(len(r.seeds))])  # fmt: skip
    title = f"{workload}: mean over seeds (min-max); TTFT P90 inf = more than 10 % failed"
    return "\n".join([title, _table(header, rows)])


def verdict_line(v: SeedVerdict) -> str:
    mark = "info" if not v.is_target else "met " if v.is_met_on_mean else "MISS"
    per_seed = " / ".join(_n(x, digits=2) for x in v.value.per_seed)
    seeds = ",".join(str(s) for s in v.seeds)
    met = f"; met at {v.met_seeds} of {len(v.seeds)}" if v.is_target else ""
    return (f"  {mark} {v.name}: mean {_n(v.value.mean, digits=2)} (min "
            f"{_n(v.value.min, digits=2)}, max {_n(v.value.max, digits=2)}; seeds {seeds}: "
            f"{per_seed}{met}) (target {v.target})")  # fmt: skip


def render_seeds(runs: Runs) -> str:
    spec, config = runs[0][1].spec, runs[0][1].config
    seeds = ", ".join(str(seed) for seed, _ in runs)
    parts = [
        f"cluster: {spec.num_workers} workers, profile {spec.profile.name} "
        f"({spec.engine_config().num_kv_blocks} KV blocks of {spec.profile.block_size} tokens "
        f"each), SLO TTFT {config.slo.ttft_s:g} s; seeds {seeds}",
        "",
    ]
    rungs = rung_spreads(runs)
    for workload in dict.fromkeys(r.workload for r in rungs):
        parts += [_workload_table(workload, [r for r in rungs if r.workload == workload]), ""]
    parts.append("targets for the default router (kvflow), judged on the mean over seeds of "
                 "each seed's value:")  # fmt: skip
    parts += [verdict_line(v) for v in results_verdicts(runs)]
    return "\n".join(parts)


def _num(value: float) -> float | None:
    """JSON has no NaN or infinity: null (nothing measured; for a TTFT P90, more than
    10 % failed, as in the single-seed report)."""
    return None if math.isnan(value) or math.isinf(value) else value


def spread_dict(s: Spread) -> dict[str, Any]:
    return {"mean": _num(s.mean), "sd": _num(s.sd), "min": _num(s.min), "max": _num(s.max),
            "per_seed": [_num(v) for v in s.per_seed]}  # fmt: skip


def seeds_report_dict(runs: Runs) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "seeds": [seed for seed, _ in runs],
        "rungs": [
            {
                "workload": r.workload,
                "arm": r.arm,
                "label": r.label,
                "qps": r.qps,
                "seeds": list(r.seeds),
                "metrics": {name: spread_dict(s) for name, s in r.metrics.items()},
            }
            for r in rung_spreads(runs)
        ],
        "targets": [
            {
                "name": v.name,
                "target": v.target,
                "is_target": v.is_target,
                "is_met_on_mean": v.is_met_on_mean,
                "met_seeds": v.met_seeds,
                "seeds": list(v.seeds),
                "value": spread_dict(v.value),
                "details": list(v.details),
            }
            for v in results_verdicts(runs)
        ],
        # Each seed's whole single-seed report: `--seeds-from` reads these back.
        "runs": [report_dict(result) for _, result in runs],
    }
