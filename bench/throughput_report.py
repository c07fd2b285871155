"""bench/engine_throughput.py's terminal table (the JSON holds the same and more)."""

from __future__ import annotations

from typing import Any

BASES = ("kvflow", "kvflow-warm")  # the arms whose ratios to every other are reported


def print_table(report: dict[str, Any]) -> None:
    def cell(s: dict[str, float], fmt: str = ".1f") -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    print(f"\ntokens/s, median of {report['runs']} runs (range); ratios of medians")
    for m in report["models"]:
        s = m["summary_tokens_per_s"]
        print(f"\n{m['model']}: {m['workload']['num_requests']} requests")
        for arm, stats in s.items():
            extra = ""
            for base in BASES:
                key = base.replace("-", "_")
                ratio = m.get(f"{key}_ratio_of_medians", {}).get(arm)
                per_run = m.get(f"{key}_ratio_per_run", {}).get(arm)
                if ratio is not None:
                    extra += f"  {base} {ratio:.2f}x (per run {cell(per_run, '.2f')})"
            print(f"  {arm:<13} {cell(stats)}{extra}")
        if "prefix_caching" in m:
            print(f"  prefix-cache TTFT {m['prefix_caching']['ttft_speedup']:.1f}x")
