"""The router's circuit breaker flags (docs/router.md, "Circuit breaker")."""

from __future__ import annotations

import argparse

from kvflow.proto.cli_args import fraction, positive_int, seconds
from kvflow.router.breaker.machine import BreakerConfig, BreakerConfigError
from kvflow.router.settings import ConfigError


def breaker_flags(p: argparse.ArgumentParser, d: BreakerConfig) -> None:
    g = p.add_argument_group(
        "circuit breaker",
        "stop sending to a worker, or answering for a pool, whose requests fail or stall "
        'too often; probe it after a while (docs/router.md, "Circuit breaker")',
    )
    g.add_argument("--breaker", choices=["on", "off"], default="on" if d.is_enabled else "off",
                   help="off: circuits stay closed (default: %(default)s)")  # fmt: skip
    g.add_argument(
        "--breaker-error-rate",
        type=fraction,
        default=d.failure_rate,
        metavar="FRACTION",
        help="a circuit opens when at least this share of its requests in the window failed "
        "(an error or a timeout; one stall opens a worker's at once) (default: %(default)s)",
    )
    g.add_argument(
        "--breaker-window-s",
        type=seconds(allow_zero=False),
        default=d.window_s,
        metavar="S",
        help="the sliding window the share is taken over (default: %(default)s)",
    )
    g.add_argument(
        "--breaker-min-requests",
        type=positive_int,
        default=d.min_requests,
        metavar="N",
        help="the fewest requests in the window the share is judged from (default: %(default)s)",
    )
    g.add_argument(
        "--breaker-open-s",
        type=seconds(allow_zero=False),
        default=d.open_s,
        metavar="S",
        help="how long a circuit stays open before probes; doubled for each re-open in a "
        "row (default: %(default)s)",
    )
    g.add_argument(
        "--breaker-max-open-s",
        type=seconds(allow_zero=False),
        default=d.max_open_s,
        metavar="S",
        help="the longest a circuit stays open, however often it re-opens (default: %(default)s)",
    )
    g.add_argument(
        "--breaker-half-open-probes",
        type=positive_int,
        default=d.half_open_probes,
        metavar="N",
        help="requests a half-open circuit lets through; that many successes close it, one "
        "failure re-opens it (default: %(default)s)",
    )


def parse_breaker(args: argparse.Namespace) -> BreakerConfig:
    try:
        return BreakerConfig(
            is_enabled=args.breaker == "on",
            failure_rate=args.breaker_error_rate,
            window_s=args.breaker_window_s,
            min_requests=args.breaker_min_requests,
            open_s=args.breaker_open_s,
            max_open_s=args.breaker_max_open_s,
            half_open_probes=args.breaker_half_open_probes,
        )
    except BreakerConfigError as exc:
        raise ConfigError(str(exc)) from exc
