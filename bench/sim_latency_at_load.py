"""TTFT and TPOT at the percentile, over their targets, for a static pool of simulated
workers at given shares of the capacity profile's load (the autoscale benchmark's setup,
docs/benchmarks.md). It shows where the planner's latency calm gate (60 % of target)
opens: a scale-down needs the role's latency under it.

    python bench/sim_latency_at_load.py --replicas 4 --utilizations 0.5 0.6 0.7 0.8
"""

from __future__ import annotations

import argparse

from kvflow.sim.autoscale import run
from kvflow.sim.autoscale_bench import BenchConfig, shares, steady
from kvflow.sim.autoscale_policies import Static


def _at(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[int(fraction * (len(ordered) - 1))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--utilizations", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8])
    parser.add_argument("--seconds", type=float, default=120.0, help="steady traffic per point")
    args = parser.parse_args(argv)
    config = BenchConfig(admission_max_queue_s=0.5, probe_s=args.seconds)
    per_share = 1.0 / shares(config, 1.0)  # requests/s one replica's share carries
    q, p = config.slo.percentile / 100, f"p{config.slo.percentile:.0f}"
    print(f"| share of capacity | requests/s | TTFT {p} / target | TPOT {p} / target |")
    print("|---|---|---|---|")
    for u in args.utilizations:
        rate = per_share * u * args.replicas
        result = run(config.sim_profile(), steady(config, rate), Static("probe", args.replicas),
                     startup_s=0, slo=config.slo, admission=config.admission())  # fmt: skip
        served = [r for r in result.records if r.error is None and r.token_times_s]
        ttft = [r.token_times_s[0] - r.sent_s for r in served]
        tpot = [(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                for r in served if len(r.token_times_s) > 1]  # fmt: skip
        print(f"| {u:.0%} | {rate:.1f} | {_at(ttft, q) / config.slo.ttft_s:.2f} "
              f"| {_at(tpot, q) / config.slo.tpot_s:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
