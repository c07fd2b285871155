"""bench/engine_roofline.py's terminal table (the JSON holds the same and more)."""

from __future__ import annotations

from typing import Any


def print_table(report: dict[str, Any]) -> None:
    print()
    print(
        "| model | dtype | streamed GB/s | b1 engine tok/s (GB/s) | **b1 % of stream** | "
        "b1 GEMM ceiling tok/s (GB/s) | b1 % of GEMM ceiling | b64 engine tok/s | "
        "b64 ceiling tok/s (GFLOP/s) | b64 % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")

    def cell(s: dict[str, float], fmt: str = ".1f") -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    for m in report["models"]:
        s = m["summary"]
        print(
            f"| {m['model']} | {m['dtype']} | {cell(s['stream_gb_s'])} | "
            f"{cell(s['engine_b1_tok_s'])} ({s['engine_b1_gb_s']['median']:.1f}) | "
            f"**{cell(s['pct_b1_of_stream'], '.0f')}** | {cell(s['ceiling_b1_tok_s'])} "
            f"({s['ceiling_b1_gb_s']['median']:.1f}) | {cell(s['pct_b1'], '.0f')} | "
            f"{cell(s['engine_b64_tok_s'])} | {cell(s['ceiling_b64_tok_s'])} "
            f"({s['ceiling_b64_gflop_s']['median']:.0f}) | {cell(s['pct_b64'], '.0f')} |"
        )
    for m in report["models"]:
        for batch, p in (m["profile"] or {}).items():
            print(f"\n{m['model']} {m['dtype']}, batch {batch}: ms per decode step")
            for part, ms in p["ms_per_step"].items():
                print(f"  {part:<28} {ms:8.2f}  ({100 * ms / p['ms_per_step']['step']:.0f} %)")
