"""The numbers of `bench/pd_real.py` per arm, their ratios to colocated, and the tables.

An arm's numbers pool the records of its **valid** runs (a P99 of two runs' ITLs, not a
mean of two P99s); each run's own numbers stay in the JSON beside them. Ratios are arm /
colocated, so below 1 is better for latencies and above 1 better for throughput.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from pd_real_pool import Arm
from pd_real_traffic import Kind, Traffic, summarize_run

from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import ScheduleLimits

BASELINE = "colocated"
# (label, path into an arm's "pooled" dict): the columns of the arms table and the ratios.
COLUMNS = (
    ("stream ITL p50", ("streams", "itl_s", "p50")),
    ("stream ITL p99", ("streams", "itl_s", "p99")),
    ("stream TPOT p50", ("streams", "tpot_s", "p50")),
    ("stream TTFT p50", ("streams", "ttft_s", "p50")),
    ("stream TTFT p90", ("streams", "ttft_s", "p90")),
    ("long TTFT p50", ("long", "ttft_s", "p50")),
    ("long TTFT p90", ("long", "ttft_s", "p90")),
)


def _get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def aggregate(
    runs: Sequence[Mapping[str, Any]],
    records: Sequence[Sequence[RequestRecord]],
    arms: Sequence[Arm],
    traffic: Traffic,
    limits: ScheduleLimits,
) -> dict[str, Any]:
    """Per arm: pooled numbers over its valid runs, and their ratios to colocated."""
    out: dict[str, Any] = {}
    for arm in arms:
        mine = [i for i, r in enumerate(runs) if r["arm"] == arm.name]
        valid = [i for i in mine if runs[i]["valid"]]
        pooled = [rec for i in valid for rec in records[i]]
        summary = asdict(summarize_run(pooled, traffic, limits)) if pooled else None
        if summary is not None:
            del summary["schedule"]  # per run only: pooled runs have no one schedule
            # The rate of each run, averaged: pooled windows would overlap.
            rates = [runs[i]["summary"]["output_tokens_per_s"] for i in valid]
            summary["output_tokens_per_s"] = sum(rates) / len(rates)
        out[arm.name] = {
            "num_runs": len(mine),
            "num_valid_runs": len(valid),
            "pooled": summary,
            "disaggregated_share": _share(runs, valid),
        }
    base = out.get(BASELINE, {}).get("pooled")
    for result in out.values():
        ratios: dict[str, float | None] = {}
        for label, path in (*COLUMNS, ("output tok/s", ("output_tokens_per_s",))):
            mine, theirs = _get(result["pooled"] or {}, path), _get(base or {}, path)
            ratios[label] = round(mine / theirs, 3) if mine is not None and theirs else None
        result["vs_colocated"] = ratios
    return out


def _share(runs: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> float | None:
    """Disaggregated plans over all plans, from the gateway's counters."""
    pd = total = 0.0
    for i in indices:
        for key, value in runs[i]["pd_counters"].items():
            if key.startswith("kvflow_router_pd_decisions_total"):
                total += value
                pd += value if "decision=disaggregated" in key else 0.0
    return round(pd / total, 3) if total else None


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sweep_table(sweep: Mapping[str, Any]) -> str:
    rows = []
    for row in sweep["rows"]:
        pd, local = row["pd"], row["local"]
        rows.append([str(row["prompt_tokens"]), _ms(local["ttft_s"]), _ms(pd["ttft_s"]),
                     f"{row.get('pd_over_local', '-')}", _ms(row.get("pd_extra_ttft_s")),
                     _ms(local["decode_cpu_s"]), _ms(pd["decode_cpu_s"]),
                     f"{pd['num_disaggregated']}/{len(pd['ttft_all_s'])}"])  # fmt: skip
    header = ["prompt", "TTFT local ms", "TTFT PD ms", "PD/local", "PD extra ms",
              "decode CPU local ms", "decode CPU PD ms", "shipped"]  # fmt: skip
    return (f"threshold sweep (median of {sweep['repetitions']}; crossover: "
            f"{sweep['crossover_tokens']})\n" + _table(header, rows))  # fmt: skip


def arms_table(arms: Mapping[str, Any]) -> str:
    header = ["arm", "valid", *[c[0] for c in COLUMNS], "out tok/s", "PD share"]
    rows, ratio_rows = [], []
    for name, result in arms.items():
        pooled = result["pooled"] or {}
        rate = pooled.get("output_tokens_per_s")
        share = result["disaggregated_share"]
        rows.append([name, f"{result['num_valid_runs']}/{result['num_runs']}",
                     *[_ms(_get(pooled, path)) for _, path in COLUMNS],
                     "-" if rate is None else f"{rate:.1f}",
                     "-" if share is None else f"{share:.0%}"])  # fmt: skip
        ratios = result["vs_colocated"]
        ratio_rows.append([name, "", *[f"{ratios[c[0]]}x" if ratios[c[0]] else "-"
                                       for c in COLUMNS],
                           f"{ratios['output tok/s']}x" if ratios["output tok/s"] else "-",
                           ""])  # fmt: skip
    return ("latency (ms), pooled over valid runs\n" + _table(header, rows)
            + "\n\nratio to colocated\n" + _table(header, ratio_rows))  # fmt: skip


def runs_table(runs: Sequence[Mapping[str, Any]]) -> str:
    header = ["arm", "streams/s", "rep", "valid", "ITL p99", "long TTFT p50", "n stream/long",
              "lag p99 ms", "load 1m", "other jobs CPU s", "wall s"]  # fmt: skip
    rows = []
    for r in runs:
        s, cpu = r["summary"], r["cpu"]
        n = s["num_measured"]
        rows.append([r["arm"], f"{r['stream_rate_per_s']:g}", str(r["repetition"]),
                     "yes" if r["valid"] else "NO",
                     _ms(s["streams"]["itl_s"]["p99"]), _ms(s["long"]["ttft_s"]["p50"]),
                     f"{n[Kind.STREAM]}/{n[Kind.LONG]}", _ms(s["schedule"]["lag_s"]["p99"]),
                     "->".join(f"{x:g}" for x in cpu["load_avg_1m"]),
                     f"{cpu['other_jobs_cpu_s']:g}", f"{cpu['wall_s']:g}"])  # fmt: skip
    return "runs\n" + _table(header, rows)


def print_report(report: Mapping[str, Any]) -> None:
    if "threshold_sweep" in report:
        print(sweep_table(report["threshold_sweep"]) + "\n")
    for point in report["load_points"]:
        print(f"== {point['stream_rate_per_s']:g} streams/s ==")
        print(arms_table(point["arms"]) + "\n")
    print(runs_table(report["runs"]))
    for r in report["runs"]:
        for problem in r["problems"]:
            print(f"  {_run_name(r)} invalid: {problem}")
        for kind, message in r["summary"]["error_examples"].items():
            print(f"  {_run_name(r)} {kind}: {message}")


def _run_name(run: Mapping[str, Any]) -> str:
    return f"{run['arm']} @{run['stream_rate_per_s']:g}/s #{run['repetition']}"
