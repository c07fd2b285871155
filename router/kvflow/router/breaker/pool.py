"""A pool's circuit: when the gateway answers a pool's requests at once with 503 instead of
preparing and queueing them for workers that cannot take them.

Open when the pool's own breaker is (its requests, after failover, fail too often), or when
every healthy worker's circuit admits nothing (each open, or half-open with its probes
out). A pool with no healthy worker at all is not this module's: that 503 says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.router.breaker.machine import Breaker, CircuitState

# Retry-After when nothing opens at a known time: half-open circuits whose probes are out
# answer within their requests' time (seconds); 1 s is the gateway's usual hint.
BUSY_PROBES_RETRY_S = 1.0


@dataclass(frozen=True)
class PoolRefusal:
    """Why the pool's circuit refuses a request now, and when to come back."""

    retry_after_s: float
    why: str  # "its requests ..." / "all 3 workers' circuits are open"


def pool_state(own: Breaker, workers: Sequence[Breaker], now_s: float) -> CircuitState:
    """The pool's circuit as the gauge shows it: its own breaker's, but OPEN while no
    healthy worker's circuit admits a request, and at least HALF_OPEN while none is closed
    (only probes get through)."""
    if workers and not any(w.admits(now_s) for w in workers):
        return CircuitState.OPEN
    if workers and not any(w.state(now_s) is CircuitState.CLOSED for w in workers):
        return max(own.state(now_s), CircuitState.HALF_OPEN)
    return own.state(now_s)


def pool_refusal(own: Breaker, workers: Sequence[Breaker], now_s: float) -> PoolRefusal | None:
    """Whether the pool's circuit refuses a request at ``now_s``; ``workers``: the breakers
    of its healthy workers."""
    if not own.admits(now_s):
        remaining_s = own.open_remaining_s(now_s)
        if remaining_s > 0:
            return PoolRefusal(remaining_s, f"its own circuit is open: {own.last_trip}")
        return PoolRefusal(BUSY_PROBES_RETRY_S, "its circuit is half-open and its probes are out")
    if workers and not any(w.admits(now_s) for w in workers):
        remaining = [w.open_remaining_s(now_s) for w in workers]
        opening = [s for s in remaining if s > 0]
        # The soonest a worker goes half-open; half-open workers with their probes out
        # answer sooner than an open one opens.
        retry_after_s = BUSY_PROBES_RETRY_S if len(opening) < len(remaining) else min(opening)
        last = max(workers, key=lambda w: w.open_remaining_s(now_s))
        which = "the circuit of its one healthy worker is open"
        if len(workers) > 1:
            which = f"the circuits of all its {len(workers)} healthy workers are open"
        return PoolRefusal(retry_after_s, f"{which} (the last to open: {last.last_trip})")
    return None
