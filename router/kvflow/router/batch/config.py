"""The Batch API's settings and flags (docs/router.md, "Batch API")."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

from kvflow.proto.cli_args import positive_int, seconds
from kvflow.router.batch.pacing import DEFAULT_TPOT_HEADROOM_FRACTION, TpotHeadroom

DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_LINES = 50_000
DEFAULT_MAX_IN_FLIGHT = 4
DEFAULT_WINDOW_S = 24 * 3600.0
DEFAULT_PRICE_FACTOR = Fraction(1, 2)


@dataclass(frozen=True)
class BatchConfig:
    # Where files and batches live without Redis (with it, in Redis); neither: API off.
    batch_dir: Path | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # an upload past it is a 413
    max_lines: int = DEFAULT_MAX_LINES  # requests per batch; more fails it at validation
    # Batch lines this router runs at once, over all batches and tenants.
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    # How long "24h" lasts: shorter in tests and drills, never on the wire.
    completion_window_s: float = DEFAULT_WINDOW_S
    # A batch line's spend is its price times this (0.5: half price).
    price_factor: Fraction = DEFAULT_PRICE_FACTOR
    poll_interval_s: float = 0.5  # how often the runner looks for work and capacity
    # After admission refused a line (429/503), the runner waits this, doubling to 30 s.
    busy_backoff_s: float = 1.0
    # The tightest online TPOT target of the pool's models (seconds): a line starts only
    # while every worker's decode step with it stays within ``tpot_headroom_fraction`` of
    # it (batch/pacing.py). 0: no target, lines wait for queues only.
    online_tpot_target_s: float = 0.0
    tpot_headroom_fraction: float = DEFAULT_TPOT_HEADROOM_FRACTION

    @property
    def tpot_headroom(self) -> TpotHeadroom | None:
        if self.online_tpot_target_s <= 0:
            return None
        return TpotHeadroom(self.online_tpot_target_s, self.tpot_headroom_fraction)


def _factor(text: str) -> Fraction:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_finite() or not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return Fraction(value)


def _headroom(text: str) -> float:
    value = _factor(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be above 0 (and at most 1), got 0")
    return float(value)


def add_batch_flags(p: argparse.ArgumentParser) -> None:
    d = BatchConfig()
    g = p.add_argument_group('Batch API (docs/router.md, "Batch API")')
    g.add_argument("--batch-dir", metavar="DIR",
                   help="keep batch files and batches here (a volume) when there is no "
                   "--redis-url; with neither the Batch API is off")  # fmt: skip
    g.add_argument(
        "--batch-max-file-bytes",
        type=positive_int,
        default=d.max_file_bytes,
        metavar="BYTES",
        help="largest upload; larger is a 413 (default: %(default)s)",
    )
    g.add_argument("--batch-max-lines", type=positive_int, default=d.max_lines, metavar="N",
                   help="most requests in one batch (default: %(default)s)")  # fmt: skip
    g.add_argument("--batch-max-in-flight", type=positive_int, default=d.max_in_flight,
                   metavar="N", help="batch requests this router runs at once, in spare "
                   "capacity only (default: %(default)s)")  # fmt: skip
    g.add_argument("--batch-completion-window-s", type=seconds(allow_zero=False),
                   default=d.completion_window_s, metavar="S",
                   help='how long a "24h" window lasts (default: %(default)s)')  # fmt: skip
    g.add_argument("--batch-price-factor", type=_factor, default=d.price_factor,
                   metavar="F", help="batch requests cost their price times this, "
                   "0 to 1 (default: 0.5)")  # fmt: skip
    g.add_argument("--batch-online-tpot-target-s", type=seconds(allow_zero=True),
                   default=d.online_tpot_target_s, metavar="S",
                   help="the tightest online TPOT target: a batch request starts only while "
                   "every worker's decode step with it stays within the headroom fraction "
                   "of it; 0: no target, batch requests wait for queues only "
                   "(default: %(default)s)")  # fmt: skip
    g.add_argument("--batch-tpot-headroom-fraction", type=_headroom,
                   default=d.tpot_headroom_fraction, metavar="F",
                   help="share of --batch-online-tpot-target-s a decode step may reach with "
                   "a batch request added, above 0 to 1 (default: %(default)s)")  # fmt: skip


def batch_config(args: argparse.Namespace) -> BatchConfig:
    return BatchConfig(
        batch_dir=Path(args.batch_dir) if args.batch_dir else None,
        max_file_bytes=args.batch_max_file_bytes,
        max_lines=args.batch_max_lines,
        max_in_flight=args.batch_max_in_flight,
        completion_window_s=args.batch_completion_window_s,
        price_factor=args.batch_price_factor,
        online_tpot_target_s=args.batch_online_tpot_target_s,
        tpot_headroom_fraction=args.batch_tpot_headroom_fraction,
    )
