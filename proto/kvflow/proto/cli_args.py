"""argparse types the command lines share (the router's, the worker's, `kvflow up`'s, the
operator's): seconds and other amounts, fractions, positive integers and ports. Each refuses
a bad value when the flags are parsed, as a usage error naming the flag, so that nothing
later meets it (a worker's --block-size 0 divided by zero, a NaN KV size became "cannot
convert float NaN to integer")."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def is_positive(value: float) -> bool:
    """A finite number above zero. (``value <= 0`` lets NaN and infinity through: a NaN
    rate reached ``math.ceil`` as "cannot convert float NaN to integer".)"""
    return math.isfinite(value) and value > 0


def is_non_negative(value: float) -> bool:
    """A finite number at or above zero."""
    return math.isfinite(value) and value >= 0


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    return number_of("seconds", allow_zero=allow_zero)


def number_of(unit: str, *, allow_zero: bool) -> Callable[[str], float]:
    """A finite count of ``unit`` (seconds, MiB...), above zero unless ``allow_zero``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (is_non_negative(value) if allow_zero else is_positive(value)):
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


# A TCP port (``--port``, ``--metrics-port``...): 0, any free port, to 65535. Past that,
# gRPC binds the number modulo 65536 (a worker asked for 99999 listened on 34463, and for -5
# on 65531) and a socket refuses it only with a traceback.
MAX_PORT = 65535


def port_number(text: str) -> int:
    """``text`` as a port, for argparse's ``type=``: a clear usage error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port: give a number from 0 (any free port) to {MAX_PORT}"
        ) from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"{value} is not a port: give a number from 0 (any free port) to {MAX_PORT}"
        )
    return value
