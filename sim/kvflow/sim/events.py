"""A discrete-event clock: callbacks run in time order, ties in the order they were set.

The sequence number breaks ties, so two events at the same virtual time always run in
the same order and a run is a pure function of its inputs and seed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` at ``time_s`` (never in the past: a late time runs now)."""
        heapq.heappush(self._heap, (max(time_s, self.now_s), next(self._seq), callback))

    def after(self, delay_s: float, callback: Callable[[], None]) -> None:
        self.at(self.now_s + delay_s, callback)

    def run(self) -> None:
        """Run events until none is left."""
        while self._heap:
            self.now_s, _, callback = heapq.heappop(self._heap)
            callback()

    def __len__(self) -> int:
        return len(self._heap)
