"""The SLO planner benchmark in virtual time (docs/benchmarks.md, "SLO planner").

    python -m kvflow.sim.autoscale_cli --json out/bench/autoscale.json \
        --plot out/bench/autoscale.png [--quick] [--jobs 2]

Prints the table as markdown. `--quick` is a smoke run (short traffic, two delays).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from kvflow.engine_worker.sim.profile_file import ProfileError
from kvflow.loadgen.report_json import write_json
from kvflow.proto.cli_args import fraction, number_of, positive_int, seconds
from kvflow.sim.autoscale import Slo
from kvflow.sim.autoscale_bench import (
    ARMS,
    BenchConfig,
    Cell,
    follower_replica_hours,
    run_grid,
)
from kvflow.sim.autoscale_metrics import Score
from kvflow.sim.autoscale_report import plot, report_dict, table
from kvflow.sim.autoscale_traffic import SHAPES

# Each refuses NaN, infinity and numbers out of range as a usage error naming the flag (a
# NaN peak rate ended in "cannot convert float NaN to integer").
_RATE = number_of("requests a second", allow_zero=False)
_MS = number_of("ms", allow_zero=False)
_RATIO = number_of("times the target", allow_zero=False)
_SECONDS = seconds(allow_zero=False)
_SECONDS_OR_0 = seconds(allow_zero=True)


def parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="python -m kvflow.sim.autoscale_cli",
                                description="The SLO planner against static and reactive "
                                "scaling, in virtual time.")  # fmt: skip
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    p.add_argument("--peak-rate", type=_RATE, default=d.peak_rate_per_s, help="req/s")
    p.add_argument("--slo-ttft-ms", type=_MS, default=d.slo.ttft_s * 1e3)
    p.add_argument("--slo-tpot-ms", type=_MS, default=d.slo.tpot_s * 1e3)
    p.add_argument("--shapes", nargs="+", default=list(d.shapes), choices=SHAPES)
    p.add_argument("--startups", nargs="+", type=_SECONDS_OR_0, default=list(d.startups_s),
                   help="pod start-up delays, seconds")  # fmt: skip
    p.add_argument("--arms", nargs="+", default=list(d.arms), choices=ARMS)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--utilization", nargs=2, type=fraction, metavar=("UP", "DOWN"),
                   help="the planner's target and scale-down utilisation (default: its "
                   "own)")  # fmt: skip
    p.add_argument("--calm-latency-ratio", type=_RATIO, metavar="R",
                   help="the planner scales down only while latency is under R x its "
                   "target (autoscaling.scaleDownLatencyRatio; default: its own, 0.6)")  # fmt: skip
    p.add_argument("--forecast-damping-s", type=_SECONDS, metavar="S",
                   help="the planner trusts a load slope for S seconds on average "
                   "(Tuning.forecast_damping_s; default: its own, 60)")  # fmt: skip
    p.add_argument("--planner-interval", type=_SECONDS, default=d.planner_interval_s,
                   help="the planner's intervalSeconds (default: the CRD's)")  # fmt: skip
    p.add_argument("--stabilization-s", type=_SECONDS_OR_0, default=d.stabilization_s,
                   help="the planner's and the reactive arm's scale-down stabilization "
                   "window, seconds")  # fmt: skip
    p.add_argument("--max-replicas", type=positive_int, default=d.max_replicas,
                   help="every dynamic arm's ceiling, and the static search's")  # fmt: skip
    p.add_argument("--proportional-margin", action="store_true",
                   help="the planner's margin in proportion to the load at every pool "
                   "size (default: pooled above 4 shares, docs/planner.md)")  # fmt: skip
    p.add_argument("--admission-max-queue-s", type=_SECONDS, metavar="S",
                   help="the gateway refuses (503) a request whose best queue is longer "
                   "than S seconds, in every arm (default: off, every request queues)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke run: 5-10 minute traffic")
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="cells run side by side, in processes that end with this one",
    )
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plot", help="write replicas and TTFT over time here (PNG)")
    return p


def config_from(args: argparse.Namespace) -> BenchConfig:
    config = BenchConfig(
        profile=args.profile,
        max_num_seqs=args.max_num_seqs,
        peak_rate_per_s=args.peak_rate,
        slo=Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3),
        shapes=tuple(args.shapes),
        startups_s=tuple(args.startups),
        arms=tuple(args.arms),
        seed=args.seed,
        utilization=tuple(args.utilization) if args.utilization else None,
        calm_latency_ratio=args.calm_latency_ratio,
        forecast_damping_s=args.forecast_damping_s,
        planner_interval_s=args.planner_interval,
        admission_max_queue_s=args.admission_max_queue_s,
        max_replicas=args.max_replicas,
        stabilization_s=args.stabilization_s,
        pooled_margin=not args.proportional_margin,
    )
    if args.quick:
        config = dataclasses.replace(
            config,
            durations_s={"diurnal": 600.0, "step": 600.0, "trace": 300.0},
            startups_s=tuple(s for s in config.startups_s if s in (0.0, 60.0)) or (0.0,),
            probe_s=60.0,
        )
    return config


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    p = parser()
    args = p.parse_args(list(argv))
    if args.utilization and args.utilization[1] >= args.utilization[0]:
        p.error(f"--utilization: DOWN ({args.utilization[1]}) must be under UP "
                f"({args.utilization[0]}): the gap between them keeps the planner from "
                "scaling back and forth")  # fmt: skip
    try:
        config = config_from(args)
        config.sim_profile()
        capacity = config.capacity()
    except (ProfileError, ValueError) as exc:
        print(f"autoscale: {exc}", file=err)
        return 2
    print(f"autoscale: capacity per replica {capacity.max_prompt_tokens_per_s:.0f} prompt "
          f"tokens/s, {capacity.max_decode_tokens_per_s:.0f} output tokens/s "
          f"({capacity.source})",
          file=err, flush=True)  # fmt: skip
    start = time.monotonic()

    def done(cell: Cell, score: Score) -> None:
        print(f"autoscale: {cell.shape} / {cell.arm} / {cell.startup_s:.0f} s: "
              f"{score.attainment:.1%}, {score.replica_hours:.2f} replica-hours "
              f"({time.monotonic() - start:.0f} s)", file=err, flush=True)  # fmt: skip

    rows = run_grid(config, jobs=args.jobs, done=done)
    bound = {shape: follower_replica_hours(config, shape) for shape in config.shapes}
    ahead = {
        shape: {s: follower_replica_hours(config, shape, s) for s in config.startups_s if s > 0}
        for shape in config.shapes
    }
    print(table(rows, bound, ahead), file=out, flush=True)
    if args.json:
        write_json(args.json, report_dict(config, rows, bound, ahead))
        print(f"autoscale: wrote {args.json}", file=err)
    if args.plot:
        plot(rows, config.slo, args.plot, startup_s=60.0 if 60.0 in config.startups_s else 0.0)
        print(f"autoscale: wrote {args.plot}", file=err)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], sys.stdout, sys.stderr))
