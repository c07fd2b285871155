"""`kvflow sim cascade`: a model cascade on a mixed workload, in virtual time
(sim/cascade.py; docs/benchmarks.md, "Model cascade")."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvflow.proto.cli_args import number_of, positive_int
from kvflow.sim.cascade import CascadeScenario, PromptKind, run, summary

_KEYS = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s")
_HEADS = ("TTFT P50", "TTFT P90", "E2E P50", "E2E P90")


def parser() -> argparse.ArgumentParser:
    d = CascadeScenario()
    easy, hard = d.kinds
    p = argparse.ArgumentParser(
        prog="kvflow sim cascade", description="A small-then-large model cascade, in virtual time."
    )
    p.add_argument("--requests", type=positive_int, default=d.num_requests)
    p.add_argument(
        "--rate-rps",
        type=number_of("requests/s", allow_zero=False),
        default=d.rate_rps,
        help="Poisson arrivals",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--hard-share", type=float, default=hard.share,
                   help="share of hard prompts (the rest are easy)")  # fmt: skip
    p.add_argument("--easy-failure-rate", type=float, default=easy.small_failure_rate,
                   help="share of easy prompts the small model's answer fails")  # fmt: skip
    p.add_argument("--hard-failure-rate", type=float, default=hard.small_failure_rate)
    p.add_argument("--small-workers", type=positive_int, default=d.small.num_workers)
    p.add_argument("--large-workers", type=positive_int, default=d.large.num_workers)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--plot", help="write latency per outcome and cost here (PNG)")
    return p


def scenario(args: argparse.Namespace) -> CascadeScenario:
    d = CascadeScenario()
    easy, hard = d.kinds
    for name in ("hard_share", "easy_failure_rate", "hard_failure_rate"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.requests < 1 or args.rate_rps <= 0 or min(args.small_workers, args.large_workers) < 1:
        raise ValueError("--requests, --rate-rps and the worker counts must be positive")
    kinds: tuple[PromptKind, ...] = (
        replace(easy, share=1 - args.hard_share, small_failure_rate=args.easy_failure_rate),
        replace(hard, share=args.hard_share, small_failure_rate=args.hard_failure_rate),
    )
    return replace(d, kinds=kinds, num_requests=args.requests, rate_rps=args.rate_rps,
                   seed=args.seed, small=replace(d.small, num_workers=args.small_workers),
                   large=replace(d.large, num_workers=args.large_workers))  # fmt: skip


def render(s: dict[str, Any]) -> str:
    lines = [f"requests {s['requests']}, escalated {s['escalated_fraction']:.1%} "
             f"(" + ", ".join(f"{k} {v['escalated_fraction']:.1%}"
                               for k, v in s["by_kind"].items()) + ")",
             f"cost: cascade ${s['cost_usd']['cascade']:.4f} vs all-large "
             f"${s['cost_usd']['all_large']:.4f}: {s['cost_saved_fraction']:.1%} saved",
             f"{'outcome':<16}{'n':>6}" + "".join(f"{h:>10}" for h in _HEADS)]  # fmt: skip
    for name, lat in s["latency"].items():
        if lat["requests"]:
            lines.append(f"{name:<16}{lat['requests']:>6}" + "".join(
                f"{lat[k]:>9.2f}s" for k in _KEYS
            ))  # fmt: skip
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes = [k for k, v in s["latency"].items() if v["requests"]]
    fig, (lat_ax, cost_ax) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 1])
    width = 0.2
    for i, (key, label) in enumerate(zip(_KEYS, _HEADS, strict=True)):
        xs = [j + (i - 1.5) * width for j in range(len(outcomes))]
        lat_ax.bar(xs, [s["latency"][o][key] for o in outcomes], width, label=label)
    lat_ax.set_xticks(range(len(outcomes)),
                      [f"{o}\n(n={s['latency'][o]['requests']})" for o in outcomes])  # fmt: skip
    lat_ax.set_ylabel("seconds (virtual time)")
    lat_ax.set_title(f"Latency per outcome ({s['escalated_fraction']:.0%} escalated)")
    lat_ax.legend(fontsize=8)
    cost = s["cost_usd"]
    cost_ax.bar(["cascade", "all large"], [cost["cascade"], cost["all_large"]],
                color=["tab:green", "tab:gray"])  # fmt: skip
    cost_ax.set_ylabel("USD for the workload")
    cost_ax.set_title(f"Cost: {s['cost_saved_fraction']:.0%} saved")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = parser().parse_args(list(argv))
    try:
        s = summary(run(scenario(args)))
    except ValueError as exc:
        print(f"kvflow sim cascade: {exc}", file=err)
        return 2
    if not s["requests"]:
        print("kvflow sim cascade: no request finished", file=err)
        return 1
    print(render(s), file=out)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=2) + "\n")
    if args.plot:
        plot(s, args.plot)
    return 0
