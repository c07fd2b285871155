"""argparse types the router's command line shares: seconds and other amounts, fractions
and positive integers."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    return number_of("seconds", allow_zero=allow_zero)


def number_of(unit: str, *, allow_zero: bool) -> Callable[[str], float]:
    """A finite count of ``unit`` (seconds, MiB...), above zero unless ``allow_zero``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            least = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"must be a number of {unit} {least}, got {text!r}")
        return value

    return parse


def fraction(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value
