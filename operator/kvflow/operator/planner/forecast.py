"""Short-horizon load forecasts: Holt's linear smoothing on irregular samples (pure).

Holt keeps a level and a trend per second. At each sample x, dt seconds after the last:

    level' = alpha x + (1 - alpha) (level + trend dt)
    trend' = beta (level' - level) / dt + (1 - beta) trend

and forecasts level + trend h for h seconds ahead. It beat a least-squares line over the
last N samples on the benchmark's ramps (it forgets old slopes in a few samples, a line
keeps them for N), and it needs two numbers of state, not N.

A forecast is never trusted for more than `max_growth` times the load seen now: one noisy
sample on a short spacing makes a steep trend, and a replica bought on it costs a whole
stabilization window.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holt:
    """The smoothed level and trend of one load series, as of `time_s`."""

    level: float
    trend_per_s: float
    time_s: float

    def update(self, value: float, time_s: float, *, alpha: float, beta: float) -> Holt:
        dt = time_s - self.time_s
        if dt <= 0:  # a repeated or out-of-order sample: nothing new to learn from it
            return self
        predicted = self.level + self.trend_per_s * dt
        level = alpha * value + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend_per_s
        return Holt(level=level, trend_per_s=trend, time_s=time_s)

    def forecast(self, horizon_s: float) -> float:
        return max(0.0, self.level + self.trend_per_s * horizon_s)


def start_or_update(
    holt: Holt | None, value: float, time_s: float, *, alpha: float, beta: float
) -> Holt:
    if holt is None:
        return Holt(level=value, trend_per_s=0.0, time_s=time_s)
    return holt.update(value, time_s, alpha=alpha, beta=beta)


def sizing_load(now: float, holt: Holt, horizon_s: float, *, max_growth: float) -> float:
    """The load to size for: what is here now, or what is coming, whichever is more."""
    return max(now, min(holt.forecast(horizon_s), now * max_growth if now > 0 else 0.0))
