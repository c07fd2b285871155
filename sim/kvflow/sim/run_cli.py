"""`kvflow sim run`: `kvflow bench` against a simulated cluster, in virtual time.

Every workload and load option of `kvflow bench` means the same here (the parser is the
bench's own, with ``--url`` no longer required); open-loop points only, since closed loop
has no schedule to replay. Each arm runs the whole ladder on fresh clusters; the reports
are the bench's table and JSON per arm, and one plot with every arm.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.loadgen.arrivals import ArrivalKind
from kvflow.loadgen.ladder import LadderPlan
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.options import DEFAULT_DURATION_S, OptionError, build_workload, load_points
from kvflow.loadgen.options import parser as bench_parser
from kvflow.loadgen.report_json import report_dict, write_json
from kvflow.loadgen.report_table import render_report
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits
from kvflow.loadgen.trace import TraceError
from kvflow.proto.cli_args import positive_int
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.run import run_point


def parser() -> argparse.ArgumentParser:
    p = bench_parser()
    p.prog = "kvflow sim run"
    p.description = "kvflow bench against a simulated cluster in virtual time."
    for action in p._actions:  # the bench's own options, minus the endpoint
        if action.dest == "url":
            action.required = False
    c = p.add_argument_group("simulated cluster")
    c.add_argument("--profile", default="h100-llama3-8b",
                   help="a shipped profile name or a file from `kvflow profile`")  # fmt: skip
    c.add_argument("--workers", type=positive_int, default=8)
    c.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="of --workers, how many prefill (the rest decode); 0: all colocated",
    )
    c.add_argument("--num-kv-blocks", type=positive_int, help="per worker (default: the profile's)")
    c.add_argument("--arms", nargs="+", default=["kvflow"],
                   help="routing arms: kvflow round-robin least-loaded random session ideal, "
                   "or kvflow:<scorer>=<weight>,...")  # fmt: skip
    return p


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = parser().parse_args(list(argv))
    try:
        points = load_points(args)
        if any(p.kind is ArrivalKind.CLOSED for p in points):
            raise OptionError("virtual time replays open-loop schedules: --rates or --speedups")
        workload = build_workload(args)
        arms = [resolve_arm(a) for a in args.arms]
        spec = ClusterSpec(resolve_profile(args.profile), num_workers=args.workers,
                           num_prefill_workers=args.prefill_workers,
                           num_kv_blocks=args.num_kv_blocks)  # fmt: skip
    except (OptionError, TraceError, ProfileError, ValueError) as exc:
        print(f"kvflow sim run: {exc}", file=err)
        return 2
    duration_s = args.duration_s
    if duration_s is None and (args.workload != "trace" or args.rates):
        duration_s = DEFAULT_DURATION_S
    slo = Slo(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)
    plan = LadderPlan(workload, points, args.seed, args.warmup_s, duration_s, args.max_requests,
                      slo, ScheduleLimits(), spec.profile.block_size)  # fmt: skip
    arms_points: dict[str, list[LoadPointSummary]] = {}
    for arm in arms:
        summaries = []
        for index, point in enumerate(points):
            result = run_point(spec, arm, plan, point, index)
            summaries.append(result.summary)
            if not args.quiet:
                print(f"kvflow sim run: {arm.name} {point.label} done", file=err, flush=True)
        arms_points[arm.name] = summaries
        print(f"== {arm.name}: {workload.name} on {spec.num_workers} x {spec.profile.name} "
              "(virtual time)", file=out)  # fmt: skip
        print(render_report(summaries, slo), file=out, flush=True)
    if args.json:
        recorded: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "api_key"}
        recorded.update(duration_s=duration_s, profile=asdict(spec.profile))
        write_json(
            args.json, {arm: report_dict(s, slo, recorded) for arm, s in arms_points.items()}
        )
        print(f"kvflow sim run: wrote {args.json}", file=err)
    if args.plot:
        from kvflow.loadgen.plots import plot_ladders

        plot_ladders(arms_points, slo, args.plot, f"kvflow sim run: {workload.name}")
        print(f"kvflow sim run: wrote {args.plot}", file=err)
    if not any(s.throughput.num_ok for ss in arms_points.values() for s in ss):
        print("kvflow sim run: no request succeeded; see the errors above", file=err)
        return 1
    return 0
