"""The sliding window a closed circuit judges its failure rate over: verdicts of the last
``window_s``, in ten buckets.

Buckets and not one entry per request: a worker taking 1,000 requests a second would keep
30,000 entries for a 30 s window; ten buckets are ten counters whatever the rate. The cost
is resolution: a verdict leaves the window between ``window_s`` and ``window_s`` + one
bucket (10 %) after it came.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

NUM_BUCKETS = 10


@dataclass
class _Bucket:
    index: int  # floor(time / bucket width): which slice of time it counts
    num_requests: int = 0
    num_failures: int = 0


@dataclass(frozen=True)
class WindowCounts:
    num_requests: int
    num_failures: int

    @property
    def failure_rate(self) -> float:
        return self.num_failures / self.num_requests if self.num_requests else 0.0


class SlidingWindow:
    def __init__(self, window_s: float) -> None:
        assert window_s > 0, window_s
        self.window_s = window_s
        self._width_s = window_s / NUM_BUCKETS
        self._buckets: deque[_Bucket] = deque()

    def _index(self, now_s: float) -> int:
        return math.floor(now_s / self._width_s)

    def _prune(self, now_s: float) -> None:
        oldest = self._index(now_s) - NUM_BUCKETS  # this bucket and older ended a window ago
        while self._buckets and self._buckets[0].index <= oldest:
            self._buckets.popleft()

    def add(self, now_s: float, *, is_failure: bool) -> None:
        self._prune(now_s)
        index = self._index(now_s)
        if not self._buckets or self._buckets[-1].index < index:
            self._buckets.append(_Bucket(index))
        bucket = self._buckets[-1]  # (a clock that went back a little counts in the newest)
        bucket.num_requests += 1
        bucket.num_failures += is_failure

    def counts(self, now_s: float) -> WindowCounts:
        """The verdicts of the last window_s at ``now_s`` (reads only: safe from a scrape)."""
        oldest = self._index(now_s) - NUM_BUCKETS
        live = [b for b in self._buckets if b.index > oldest]
        return WindowCounts(sum(b.num_requests for b in live), sum(b.num_failures for b in live))

    def clear(self) -> None:
        self._buckets.clear()
