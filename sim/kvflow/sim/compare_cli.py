"""`kvflow sim compare`: the routing comparison of docs/benchmarks.md, in virtual time."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TextIO

from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.report_json import write_json
from kvflow.loadgen.trace import MOONCAKE_TRACE, TraceError
from kvflow.proto.cli_args import number_of, positive_int
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import (
    ARMS,
    ArmLadder,
    ComparisonConfig,
    ComparisonResult,
    ladders,
    run_comparison,
)
from kvflow.sim.report import render, report_dict

DEFAULT_TRACE = str(MOONCAKE_TRACE)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow sim compare",
                                description="The routing comparison, in virtual time.")  # fmt: skip
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format trace (JSONL)")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--workers", type=positive_int, default=8)
    p.add_argument("--num-kv-blocks", type=positive_int, help="per worker (default: the profile's)")
    p.add_argument("--arms", nargs="+", default=list(ARMS),
                   help="routing arms; kvflow:<scorer>=<weight>,... runs the gateway's "
                   "placement with other weights")  # fmt: skip
    p.add_argument("--workloads", default="shared-prefix,mooncake,no-reuse",
                   help="comma-separated: shared-prefix, mooncake, no-reuse, hot-prefix, and "
                   "the generated trace families conv-7k, conv-7k-turns, conv-2k-turns, "
                   "agent")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=number_of("ms", allow_zero=False), default=1000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=parse_seeds, metavar="N|S,S,...",
                   help="run every ladder at several seeds (each seed's arms share its "
                   "arrivals) and report the mean and range over seeds: N seeds from --seed "
                   "on, or a comma-separated list (one seed: 7,)")  # fmt: skip
    p.add_argument("--seeds-from", nargs="+", metavar="JSON",
                   help="run nothing: summarise these single-seed --json reports over their "
                   "seeds (a seed's reports merged; same cluster, SLO and --quick)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="fewer rungs and requests")
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="ladders run side by side, in processes that end with this one",
    )
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plot", help="write TTFT P90 and hit rate vs QPS here (PNG)")
    p.add_argument("--plot-from", nargs="+", metavar="JSON",
                   help="run nothing: plot these --json reports merged (same cluster and SLO; "
                   "a later file's ladder replaces an earlier one's) to --plot")  # fmt: skip
    return p


def parse_seeds(text: str) -> int | tuple[int, ...]:
    """``N``, a count of seeds from ``--seed`` on, or a comma-separated list of seeds."""
    try:
        if "," not in text:
            count = int(text)
            if count < 1:
                raise argparse.ArgumentTypeError(f"--seeds {text}: a count must be >= 1")
            return count
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds {text!r}: a count N or a comma-separated list of seeds"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds {text!r}: distinct seeds >= 0, at least one")
    return seeds


def _seeds_from(paths: Sequence[str], json_path: str | None, out: TextIO, err: TextIO) -> int:
    from kvflow.sim.report_load import ReportError, load_results, merge_by_seed

    try:
        runs = merge_by_seed(load_results(paths))
    except (ReportError, ProfileError) as exc:
        print(f"kvflow sim compare: {exc}", file=err)
        return 2
    return _report_seeds(runs, json_path, out, err)


def _report_seeds(
    runs: Sequence[tuple[int, ComparisonResult]], json_path: str | None, out: TextIO, err: TextIO
) -> int:
    from kvflow.sim.seeds_report import render_seeds, seeds_report_dict

    try:
        text = render_seeds(runs)
    except ValueError as exc:  # rungs that differ between seeds
        print(f"kvflow sim compare: {exc}", file=err)
        return 2
    print(text, file=out, flush=True)
    if json_path:
        write_json(json_path, seeds_report_dict(runs))
        print(f"kvflow sim compare: wrote {json_path}", file=err)
    return 0


def _plot_from(paths: Sequence[str], plot: str | None, err: TextIO) -> int:
    from kvflow.sim.plots import PlotError, load_reports, plot_reports

    if not plot:
        print("kvflow sim compare: --plot-from needs --plot PATH.png to write to", file=err)
        return 2
    try:
        plot_reports(load_reports(paths), plot)
    except PlotError as exc:
        print(f"kvflow sim compare: {exc}", file=err)
        return 2
    print(f"kvflow sim compare: wrote {plot} from {len(paths)} report(s)", file=err)
    return 0


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = parser().parse_args(list(argv))
    if args.plot_from:
        return _plot_from(args.plot_from, args.plot, err)
    if args.seeds_from:
        return _seeds_from(args.seeds_from, args.json, out, err)
    seeds: tuple[int, ...] = (args.seed,)
    if args.seeds is not None:
        given = args.seeds
        seeds = tuple(range(args.seed, args.seed + given)) if isinstance(given, int) else given
        if args.plot:
            print("kvflow sim compare: --plot draws one seed: leave it out with --seeds",
                  file=err)  # fmt: skip
            return 2
    arms = list(args.arms)
    try:
        profile = resolve_profile(args.profile)
        spec = ClusterSpec(profile, num_workers=args.workers, num_kv_blocks=args.num_kv_blocks)
        config = ComparisonConfig(
            trace_path=args.trace, profile=args.profile, num_workers=args.workers,
            num_kv_blocks=args.num_kv_blocks, arms=arms,
            workloads=[w for w in args.workloads.split(",") if w],
            slo=Slo(args.slo_ttft_ms / 1e3, 0.1), seed=args.seed, quick=args.quick,
            jobs=args.jobs,
        )  # fmt: skip
        for arm in arms:
            resolve_arm(arm)
        for seed in seeds:  # reads and checks the trace before any run
            ladders(dataclasses.replace(config, seed=seed))
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"kvflow sim compare: {exc}", file=err)
        return 2

    def done(item: ArmLadder) -> None:
        print(f"kvflow sim compare: {item.workload} / {item.arm}: {len(item.points)} points "
              f"in {item.wall_s:.0f} s", file=err, flush=True)  # fmt: skip

    if args.seeds is not None:
        runs = []
        for seed in seeds:
            print(f"kvflow sim compare: seed {seed}", file=err, flush=True)
            runs.append((seed, run_comparison(dataclasses.replace(config, seed=seed), spec, done)))
        return _report_seeds(runs, args.json, out, err)
    result = run_comparison(config, spec, done)
    print(render(result), file=out, flush=True)
    if args.json:
        write_json(args.json, report_dict(result))
        print(f"kvflow sim compare: wrote {args.json}", file=err)
    if args.plot:
        from kvflow.sim.plots import plot_comparison

        plot_comparison(result, args.plot)
        print(f"kvflow sim compare: wrote {args.plot}", file=err)
    return 0
