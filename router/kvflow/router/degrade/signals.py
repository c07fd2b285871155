"""The SLO signals the ladder climbs on, from the requests a model served (pure, clock passed in).

The same signals as the planner's SLOMet verdict: a burn rate is the fraction of the window's
requests over a latency target divided by the error budget (1 - percentile / 100), so 1.0
spends the budget exactly and 2.0 twice as fast. Queue time is the window's P90 wait before
a worker started a request. Refused requests count as over the TTFT target, as the planner
counts them: a shed request got no first token. The offered load is the window's arrivals
per second, every request that asked (served, degraded or refused): what the ladder's
steps do not change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    @property
    def error_budget(self) -> float:
        return max(1e-9, 1.0 - self.percentile / 100.0)


@dataclass(frozen=True)
class SloSignals:
    ttft_burn: float
    tpot_burn: float
    queue_p90_s: float
    requests: int
    offered_per_s: float = 0.0  # arrivals per second over the window (0: none recorded)

    @classmethod
    def calm(cls) -> SloSignals:
        return cls(0.0, 0.0, 0.0, 0)


@dataclass(frozen=True)
class _Sample:
    at_s: float
    ttft_s: float | None  # None: refused (counted as late)
    tpot_s: float | None  # None: one token or refused (no inter-token time)
    queue_s: float


class SloWindow:
    """The last ``window_s`` seconds of one model's requests, reduced to SloSignals."""

    def __init__(self, targets: SloTargets, window_s: float = 30.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.targets = targets
        self.window_s = window_s
        self._samples: deque[_Sample] = deque()
        self._arrivals: deque[float] = deque()

    def record_arrival(self, now_s: float) -> None:
        """One request asked for the model (before any step or refusal changed it)."""
        self._arrivals.append(now_s)
        self._expire(now_s)

    def record(
        self, now_s: float, ttft_s: float | None, tpot_s: float | None, queue_s: float = 0.0
    ) -> None:
        """One finished (or refused: ``ttft_s=None``) request."""
        self._samples.append(_Sample(now_s, ttft_s, tpot_s, queue_s))
        self._expire(now_s)

    def signals(self, now_s: float) -> SloSignals:
        self._expire(now_s)
        samples = list(self._samples)
        offered_per_s = len(self._arrivals) / self.window_s
        if not samples:
            return SloSignals(0.0, 0.0, 0.0, 0, offered_per_s)
        budget = self.targets.error_budget
        late_ttft = sum(1 for s in samples if s.ttft_s is None or s.ttft_s > self.targets.ttft_s)
        decoded = [s.tpot_s for s in samples if s.tpot_s is not None]
        late_tpot = sum(1 for t in decoded if t > self.targets.tpot_s)
        queues = sorted(s.queue_s for s in samples)
        return SloSignals(
            ttft_burn=late_ttft / len(samples) / budget,
            tpot_burn=(late_tpot / len(decoded) / budget) if decoded else 0.0,
            queue_p90_s=queues[min(len(queues) - 1, int(0.9 * len(queues)))],
            requests=len(samples),
            offered_per_s=offered_per_s,
        )

    def _expire(self, now_s: float) -> None:
        while self._samples and self._samples[0].at_s < now_s - self.window_s:
            self._samples.popleft()
        while self._arrivals and self._arrivals[0] < now_s - self.window_s:
            self._arrivals.popleft()
