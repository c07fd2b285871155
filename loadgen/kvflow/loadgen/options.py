"""`kvflow bench` options: the parser, and the workload and load points they name."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.multi_turn import MultiTurnWorkload
from kvflow.loadgen.no_reuse import NoReuseWorkload
from kvflow.loadgen.payloads import Api
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.loadgen.trace import load_trace
from kvflow.loadgen.trace_replay import TraceWorkload
from kvflow.loadgen.workload import Workload
from kvflow.proto.cli_args import is_non_negative, is_positive

WORKLOADS = ("shared-prefix", "multi-turn", "no-reuse", "trace")
DEFAULT_DURATION_S = 30.0


class OptionError(ValueError):
    """Options that parse but do not fit together; the message says what to change."""


def _numbers(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None
    if not values or not all(is_positive(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers: {text!r}")
    return values


def _ints(text: str) -> tuple[int, ...]:
    values = _numbers(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers: {text!r}")
    return tuple(int(v) for v in values)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow bench",
        description="Load an OpenAI-compatible endpoint and report TTFT, TPOT, ITL, "
        "throughput, goodput and cache hits, per load point of a ladder (docs/bench.md).",
    )
    a = p.add_argument_group("endpoint")
    a.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000/v1")
    a.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    a.add_argument("--api-key", help="sent as a bearer token")
    a.add_argument("--api", choices=[x.value for x in Api], default=Api.CHAT.value)
    a.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that refuse it)")  # fmt: skip
    a.add_argument("--route-header", action="store_true",
                   help="ask kvflow's gateway which worker served each request")  # fmt: skip
    a.add_argument("--block-size", type=int, default=16, help="router KV block size (tokens)")
    a.add_argument("--request-timeout-s", type=float, default=600.0)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    w.add_argument("--trace", help="Mooncake-format trace (JSONL) for --workload trace")
    w.add_argument("--input-scale", type=float, default=1.0, help="multiplies prompt lengths")
    w.add_argument("--output-scale", type=float, default=1.0, help="multiplies output lengths")
    w.add_argument("--output-tokens", type=int, default=32, help="synthetic workloads")
    w.add_argument("--groups", type=int, default=8, help="shared-prefix groups")
    w.add_argument("--users-per-group", type=int, default=4)
    w.add_argument("--prefix-words", type=_ints, default=(1024, 512, 256),
                   help="shared prefix lengths, one per group in turn")  # fmt: skip
    w.add_argument("--question-words", type=int, default=64)
    w.add_argument("--conversations", type=int, default=16, help="multi-turn: active at once")
    w.add_argument("--turns", type=int, default=5)
    w.add_argument("--first-message-words", type=int, default=256)
    w.add_argument("--message-words", type=int, default=64)
    w.add_argument("--prompt-words", type=int, default=512, help="no-reuse prompt length")
    w.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("load (one of --rates, --speedups, --users)")
    r.add_argument("--rates", type=_numbers, help="open-loop Poisson ladder, req/s: 1,2,4")
    r.add_argument("--speedups", type=_numbers, help="replay the trace's clock this much faster")
    r.add_argument("--users", type=_ints, help="closed-loop ladder: concurrent users")
    r.add_argument("--duration-s", type=float,
                   help=f"measured seconds per load point (default {DEFAULT_DURATION_S:g}; "
                        "a trace: all of it)")  # fmt: skip
    r.add_argument("--warmup-s", type=float, default=5.0, help="sent, not measured")
    r.add_argument("--max-requests", type=int, help="at most this many per load point")
    r.add_argument("--max-lag-ms", type=float, default=20.0,
                   help="schedule lag P99 beyond which a load point is invalid")  # fmt: skip
    o = p.add_argument_group("SLO and output")
    o.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    o.add_argument("--slo-tpot-ms", type=float, default=100.0)
    o.add_argument("--json", help="write the full report here")
    o.add_argument("--plot", help="write latency and throughput vs QPS here (PNG)")
    o.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def check_ranges(args: argparse.Namespace) -> None:
    if args.duration_s is not None and not is_positive(args.duration_s):
        raise OptionError("--duration-s must be > 0")
    if not is_non_negative(args.warmup_s):
        raise OptionError("--warmup-s must be >= 0")
    if args.max_requests is not None and args.max_requests < 1:
        raise OptionError("--max-requests must be at least 1")
    if not (is_positive(args.request_timeout_s) and is_positive(args.max_lag_ms)):
        raise OptionError("--request-timeout-s and --max-lag-ms must be > 0")
    if not (is_positive(args.slo_ttft_ms) and is_positive(args.slo_tpot_ms)):
        raise OptionError("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    if args.block_size < 1:
        raise OptionError("--block-size must be at least 1")
    lengths = ("output_tokens", "groups", "users_per_group", "question_words", "conversations",
               "turns", "first_message_words", "message_words", "prompt_words")  # fmt: skip
    for name in lengths:
        if getattr(args, name) < 1:
            raise OptionError(f"--{name.replace('_', '-')} must be at least 1")


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    check_ranges(args)
    given = [name for name in ("rates", "speedups", "users") if getattr(args, name)]
    if len(given) > 1:
        raise OptionError(f"give one of --rates, --speedups, --users, not {', '.join(given)}")
    if args.speedups and args.workload != "trace":
        raise OptionError("--speedups replays a trace's clock: it needs --workload trace")
    if args.users:
        return [LoadPoint(ArrivalKind.CLOSED, u) for u in args.users]
    if args.speedups or (not args.rates and args.workload == "trace"):
        return [LoadPoint(ArrivalKind.TRACE, s) for s in args.speedups or (1.0,)]
    return [LoadPoint(ArrivalKind.POISSON, r) for r in args.rates or (1.0,)]


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the options name; a trace is read and validated here."""
    scales = {"input_scale": args.input_scale, "output_scale": args.output_scale}
    if not all(is_positive(v) for v in scales.values()):
        raise OptionError("--input-scale and --output-scale must be > 0")
    if args.workload == "trace":
        if not args.trace:
            raise OptionError("--workload trace needs --trace PATH (a Mooncake-format JSONL)")
        return TraceWorkload(load_trace(args.trace), **scales)
    if args.trace:
        raise OptionError("--trace is for --workload trace")
    if args.workload == "shared-prefix":
        return SharedPrefixWorkload(
            num_groups=args.groups,
            users_per_group=args.users_per_group,
            prefix_words=args.prefix_words,
            question_words=args.question_words,
            output_tokens=args.output_tokens,
            **scales,
        )
    if args.workload == "multi-turn":
        return MultiTurnWorkload(
            num_active=args.conversations,
            num_turns=args.turns,
            first_message_words=args.first_message_words,
            message_words=args.message_words,
            output_tokens=args.output_tokens,
            **scales,
        )
    return NoReuseWorkload(
        prompt_words=args.prompt_words, output_tokens=args.output_tokens, **scales
    )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return parser().parse_args(list(argv))
