"""`kvflow sim overload`: a pool at twice its capacity, degradation off and on side by side.

    kvflow sim overload --json docs/bench-data/overload-ladder.json \
        --plot docs/img/overload-ladder.png
    kvflow sim overload --scenario interactive-heavy \
        --json docs/bench-data/overload-interactive.json --plot docs/img/overload-interactive.png

Prints the per-class table as markdown, the two targets and the ladder's moves; exit 0
when the run finished (the targets are reported, not enforced), 2 on bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TextIO

from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.loadgen.report_json import write_json
from kvflow.proto.cli_args import number_of, positive_int, seconds
from kvflow.proto.priority_class import PriorityClass
from kvflow.sim.arms import resolve_arm
from kvflow.sim.overload import OverloadConfig, run_overload
from kvflow.sim.overload_gateway import DEFAULT_LADDER, DEFAULT_SHED_WAIT_S, GatewayConfig
from kvflow.sim.overload_report import plot, render, report_dict
from kvflow.sim.overload_traffic import (
    DEFAULT_SCENARIO,
    MIX_FORMAT,
    SCENARIOS,
    LoadPhase,
    parse_mix,
)

# Each refuses NaN, infinity and negatives when the flags are parsed: a negative or NaN
# phase was dropped without a word, and an infinite one never ended.
_LOAD = number_of("x capacity", allow_zero=False)
_PHASE_S = seconds(allow_zero=True)  # 0: the phase is left out
_DWELL_S = seconds(allow_zero=True)


def parser() -> argparse.ArgumentParser:
    g = GatewayConfig()
    p = argparse.ArgumentParser(prog="kvflow sim overload",
                                description="A pool offered more than it can serve: "
                                "class-ordered shedding and the degradation ladder, off "
                                "and on, in virtual time.")  # fmt: skip
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="per worker")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="per step")
    p.add_argument("--routing-arm", default="kvflow")
    mix = p.add_mutually_exclusive_group()
    mix.add_argument("--scenario", choices=sorted(SCENARIOS), default=DEFAULT_SCENARIO,
                     help="the named traffic mix (docs/simulator.md)")  # fmt: skip
    mix.add_argument("--mix", metavar=MIX_FORMAT,
                     help="a traffic mix of your own, e.g. realtime:0.15:256:64,"
                     "normal:0.7:512:768,batch:0.15:1024:1024 (shares sum to 1; each "
                     "class's targets as in the named scenarios)")  # fmt: skip
    p.add_argument("--calm-load", type=_LOAD, default=0.5,
                   help="offered load before and after the overload, x capacity")  # fmt: skip
    p.add_argument("--overload-load", type=_LOAD, default=2.0, help="x capacity")
    p.add_argument("--calm-before-s", type=_PHASE_S, default=60.0)
    p.add_argument("--overload-s", type=_PHASE_S, default=240.0)
    p.add_argument("--calm-after-s", type=_PHASE_S, default=420.0)
    p.add_argument("--capacity-per-s", type=number_of("requests/s", allow_zero=False),
                   help="the pool's capacity in requests/s (default: measured)")  # fmt: skip
    p.add_argument("--capacity-requests", type=positive_int, default=600,
                   help="the burst that measures capacity")  # fmt: skip
    p.add_argument("--shed-wait-s", nargs=3, type=_DWELL_S, metavar=("BATCH", "NORMAL", "REALTIME"),
                   default=[DEFAULT_SHED_WAIT_S[c] for c in
                            (PriorityClass.BATCH, PriorityClass.NORMAL, PriorityClass.REALTIME)],
                   help="the estimated wait above which each class is refused")  # fmt: skip
    p.add_argument("--max-tokens-cap", type=positive_int, default=g.max_tokens_cap,
                   help="cap_max_tokens: most tokens a request generates while on")  # fmt: skip
    p.add_argument(
        "--window-s", type=seconds(allow_zero=False), default=g.window_s, help="the SLO window"
    )
    p.add_argument("--engage-after-s", type=_DWELL_S, default=DEFAULT_LADDER.engage_after_s,
                   help="the ladder takes its next step after this long hot")  # fmt: skip
    p.add_argument("--release-after-s", type=_DWELL_S, default=DEFAULT_LADDER.release_after_s,
                   help="the ladder reverts its last step after this long calm")  # fmt: skip
    p.add_argument("--reengage-window-s", type=_DWELL_S, default=DEFAULT_LADDER.reengage_window_s,
                   help="a step engaged again within this long of its release doubles its "
                   "next release dwell (0: never)")  # fmt: skip
    p.add_argument("--max-release-after-s", type=_DWELL_S,
                   default=DEFAULT_LADDER.max_release_after_s,
                   help="the longest release dwell the doubling reaches")  # fmt: skip
    p.add_argument("--release-offered-ratio", type=number_of("x the arrivals", allow_zero=True),
                   default=DEFAULT_LADDER.release_offered_ratio,
                   help="release a step once arrivals/s fall under this share of those when "
                   "it was taken (0: not asked)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plot", help="write load, ladder level and goodput over time here (PNG)")
    return p


def config_from(args: argparse.Namespace) -> OverloadConfig:
    profile = dataclasses.replace(resolve_profile(args.profile), max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    batch, normal, realtime = args.shed_wait_s
    gateway = GatewayConfig(
        shed_wait_s={
            PriorityClass.BATCH: batch,
            PriorityClass.NORMAL: normal,
            PriorityClass.REALTIME: realtime,
        },
        ladder=dataclasses.replace(
            DEFAULT_LADDER,
            engage_after_s=args.engage_after_s,
            release_after_s=args.release_after_s,
            reengage_window_s=args.reengage_window_s,
            max_release_after_s=args.max_release_after_s,
            release_offered_ratio=args.release_offered_ratio,
        ),
        max_tokens_cap=args.max_tokens_cap,
        window_s=args.window_s,
    )
    phases = tuple(
        LoadPhase(duration_s, load)
        for duration_s, load in (
            (args.calm_before_s, args.calm_load),
            (args.overload_s, args.overload_load),
            (args.calm_after_s, args.calm_load),
        )
        if duration_s > 0
    )
    if args.capacity_per_s is not None and args.capacity_per_s <= 0:
        raise ValueError(f"--capacity-per-s must be > 0, got {args.capacity_per_s}")
    if args.workers < 1 or args.capacity_requests < 10:
        raise ValueError("--workers must be >= 1 and --capacity-requests >= 10")
    resolve_arm(args.routing_arm)
    if args.mix is not None:
        mix, scenario = parse_mix(args.mix), "custom"
    else:
        mix, scenario = SCENARIOS[args.scenario], args.scenario
    return OverloadConfig(profile, num_workers=args.workers, routing_arm=args.routing_arm,
                          mix=mix, scenario=scenario, phases=phases, gateway=gateway,
                          capacity_requests=args.capacity_requests,
                          capacity_per_s=args.capacity_per_s, seed=args.seed)  # fmt: skip


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = parser().parse_args(list(argv))
    try:
        config = config_from(args)
    except (ProfileError, ValueError) as exc:
        print(f"kvflow sim overload: {exc}", file=err)
        return 2

    def done(stage: str, wall_s: float) -> None:
        print(f"kvflow sim overload: {stage} in {wall_s:.0f} s", file=err, flush=True)

    report = report_dict(run_overload(config, done))
    print(render(report), file=out, flush=True)
    if args.json:
        write_json(args.json, report)
        print(f"kvflow sim overload: wrote {args.json}", file=err)
    if args.plot:
        plot(report, args.plot)
        print(f"kvflow sim overload: wrote {args.plot}", file=err)
    return 0
