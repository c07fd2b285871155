"""When each request is due: open-loop schedules (Poisson, a trace's clock) and load points.

Open loop: the schedule is fixed before the run and every request is sent at its time,
whatever happened to earlier ones, so a slow server cannot slow the arrivals down and hide
its own queueing (coordinated omission). Closed loop: N users each send their next request
when the previous one ends; it has no schedule, and its rate is whatever the server allows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class ArrivalKind(StrEnum):
    POISSON = "poisson"
    TRACE = "trace"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One rung of a ladder: a Poisson rate, a trace speed-up, or a number of users."""

    kind: ArrivalKind
    value: float  # req/s for Poisson, the speed-up for a trace, users for closed loop

    @property
    def label(self) -> str:
        match self.kind:
            case ArrivalKind.POISSON:
                return f"{self.value:g} req/s"
            case ArrivalKind.TRACE:
                return f"trace x{self.value:g}"
            case ArrivalKind.CLOSED:
                return f"{self.value:g} users"

    @property
    def num_users(self) -> int:
        assert self.kind is ArrivalKind.CLOSED
        return int(self.value)


def poisson_offsets_s(rate_per_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, horizon_s) of a Poisson process: exponential gaps at the rate."""
    if rate_per_s <= 0:
        raise ValueError(f"a Poisson rate must be > 0, got {rate_per_s}")
    offsets: list[float] = []
    t_s = rng.expovariate(rate_per_s)
    while t_s < horizon_s:
        offsets.append(t_s)
        t_s += rng.expovariate(rate_per_s)
    return offsets


def trace_offsets_s(
    trace_offsets: Sequence[float], speedup: float, horizon_s: float | None = None
) -> list[float]:
    """A trace's own arrival times, ``speedup`` times faster, cut at ``horizon_s``."""
    if speedup <= 0:
        raise ValueError(f"a trace speed-up must be > 0, got {speedup}")
    offsets = [t / speedup for t in trace_offsets]
    if horizon_s is not None:
        offsets = [t for t in offsets if t < horizon_s]
    return offsets


def mean_rate_per_s(offsets_s: Sequence[float]) -> float:
    """Requests per second over a schedule's span (its first to its last arrival)."""
    if len(offsets_s) < 2 or offsets_s[-1] <= offsets_s[0]:
        return 0.0
    return (len(offsets_s) - 1) / (offsets_s[-1] - offsets_s[0])
