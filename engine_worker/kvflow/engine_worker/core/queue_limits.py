"""How long the waiting queue is allowed to get, and how long a new request would wait.

An unbounded queue turns overload into latency: every request is accepted and each waits
longer than the last, until clients time out and retry into the same queue. A bounded one
answers at once with "full, retry after N s" (gRPC RESOURCE_EXHAUSTED), and the router
tries another worker or tells the client (503 with Retry-After).

The wait is estimated from the rate at which requests leave the queue while some wait
(admissions per second, an exponentially weighted average over ``DRAIN_TIME_CONSTANT_S``):
``n`` requests ahead drain in ``n / rate`` seconds. Steps where nothing waits say nothing
about capacity (everything was admitted at once) and are not counted.

Both bounds count the requests *ahead of* a new one: the waiting requests of its priority
class and the more urgent ones (kvflow.proto.priority_class), which the scheduler admits
before it. A batch flood that fills the queue refuses more batch work but not a realtime
or normal request, which would be admitted before all of it; a request that names no class
is normal, and with no class in use every waiting request is ahead, as before classes. So
the queue holds at most the bound per class (three times it in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.engine_worker.core.errors import QueueFullError
from kvflow.proto.priority_class import PriorityClass

# Long enough to smooth over a few long prefill steps (a 2k-token chunk takes ~1 s on 2 CPU
# cores), short enough that a load change shows within a few seconds.
DRAIN_TIME_CONSTANT_S = 5.0
# Retry-After hints are whole seconds; a hint past a minute is no better than "later".
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class QueueStats:
    """What the engine thread publishes after each step for Load (replaced, never mutated)."""

    num_waiting: int = 0
    drain_rate_per_s: float = 0.0  # 0: not measured yet (the queue has not been backlogged)
    max_waiting_requests: int | None = None  # None: unbounded
    # Waiting requests per priority class, most urgent first (index: PriorityClass.rank);
    # empty: not known, every waiting request counts as ahead.
    num_waiting_by_rank: tuple[int, ...] = ()

    def num_ahead(self, priority_class: PriorityClass) -> int:
        """Waiting requests a new one of ``priority_class`` would wait behind."""
        if not self.num_waiting_by_rank:
            return self.num_waiting
        return sum(self.num_waiting_by_rank[: priority_class.rank + 1])

    def estimated_wait_s(self, num_ahead: int | None = None) -> float | None:
        """Seconds until ``num_ahead`` (default: every waiting) requests have been admitted;
        None when the rate is not known yet."""
        ahead = self.num_waiting if num_ahead is None else num_ahead
        if ahead <= 0:
            return 0.0
        return ahead / self.drain_rate_per_s if self.drain_rate_per_s > 0 else None


class DrainRateMeter:
    """Admissions per second while the queue is backlogged, exponentially weighted."""

    def __init__(self, time_constant_s: float = DRAIN_TIME_CONSTANT_S) -> None:
        self._time_constant_s = time_constant_s
        self._num_admitted = 0.0  # decayed sums
        self._elapsed_s = 0.0

    def observe(self, num_admitted: int, elapsed_s: float, *, was_backlogged: bool) -> None:
        """One step of ``elapsed_s`` that admitted ``num_admitted`` requests."""
        if not was_backlogged or elapsed_s <= 0:
            return
        decay = math.exp(-elapsed_s / self._time_constant_s)
        self._num_admitted = self._num_admitted * decay + num_admitted
        self._elapsed_s = self._elapsed_s * decay + elapsed_s

    @property
    def rate_per_s(self) -> float:
        return self._num_admitted / self._elapsed_s if self._elapsed_s > 0 else 0.0


def retry_after_s(stats: QueueStats, num_ahead: int | None = None) -> float:
    """A client's back-off: the time the queue ahead of it (default: every waiting request)
    needs to drain, within bounds."""
    wait_s = stats.estimated_wait_s(num_ahead)
    if wait_s is None:
        return MIN_RETRY_AFTER_S
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait_s))


def check_queue(
    stats: QueueStats,
    max_queue_time_s: float | None,
    priority_class: PriorityClass = PriorityClass.NORMAL,
) -> None:
    """Raise QueueFullError when one more waiting request of ``priority_class`` is over
    either bound (counting the requests ahead of it: its class and the more urgent)."""
    bound = stats.max_waiting_requests
    ahead = stats.num_ahead(priority_class)
    if bound is not None and ahead >= bound:
        raise QueueFullError(
            f"this worker's queue is full ({ahead} requests waiting, "
            f"--max-waiting-requests {bound}); retry later or elsewhere",
            retry_after_s=retry_after_s(stats, ahead),
        )
    wait_s = stats.estimated_wait_s(ahead + 1)
    if max_queue_time_s is not None and wait_s is not None and wait_s > max_queue_time_s:
        raise QueueFullError(
            f"this worker's queue would hold the request about {wait_s:.1f} s "
            f"(--max-queue-time-s {max_queue_time_s:g}); retry later or elsewhere",
            retry_after_s=retry_after_s(stats, ahead),
            reason="queue_time",
        )
