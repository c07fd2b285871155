"""Short-horizon load forecasts: Holt's linear smoothing on irregular samples (pure).

Holt keeps a level and a trend per second. At each sample x, dt seconds after the last:

    level' = alpha x + (1 - alpha) (level + trend dt)
    trend' = beta (level' - level) / dt + (1 - beta) trend

and forecasts level + trend h for h seconds ahead. It beat a least-squares line over the
last N samples on the benchmark's ramps (it forgets old slopes in a few samples, a line
keeps them for N), and it needs two numbers of state, not N.

A forecast is never trusted for more than `max_growth` times the load seen now, and its
trend only after the load rose in each of the last `min_rises` samples: one noisy sample
or one step makes a steep trend for several samples, and a replica bought on it costs a
whole stabilization window. In the virtual cluster a 5x step with a 60 s start-up made
Holt's trend ask for 12 replicas where 7 carried the load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holt:
    """The smoothed level and trend of one load series, as of `time_s`."""

    level: float
    trend_per_s: float
    time_s: float
    last_value: float = 0.0
    num_rises: int = 0  # consecutive samples above the one before

    def update(self, value: float, time_s: float, *, alpha: float, beta: float) -> Holt:
        dt = time_s - self.time_s
        if dt <= 0:  # a repeated or out-of-order sample: nothing new to learn from it
            return self
        predicted = self.level + self.trend_per_s * dt
        level = alpha * value + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend_per_s
        rises = self.num_rises + 1 if value > self.last_value else 0
        return Holt(level, trend, time_s, last_value=value, num_rises=rises)

    def forecast(self, horizon_s: float, *, min_rises: int = 0) -> float:
        """Level plus trend `horizon_s` ahead; the last sample unless the load rose in each
        of the last `min_rises` samples. A step reads as a steep trend for several samples
        after it (Holt cannot tell a jump from a ramp, and its level overshoots the step
        too); a ramp rises sample after sample."""
        if self.num_rises < min_rises:
            return self.last_value
        return max(0.0, self.level + self.trend_per_s * horizon_s)


def start_or_update(
    holt: Holt | None, value: float, time_s: float, *, alpha: float, beta: float
) -> Holt:
    if holt is None:
        return Holt(level=value, trend_per_s=0.0, time_s=time_s, last_value=value)
    return holt.update(value, time_s, alpha=alpha, beta=beta)


def sizing_load(
    now: float, holt: Holt, horizon_s: float, *, max_growth: float, min_rises: int = 0
) -> float:
    """The load to size for: what is here now, or what is coming, whichever is more."""
    ahead = holt.forecast(horizon_s, min_rises=min_rises)
    return max(now, min(ahead, now * max_growth if now > 0 else 0.0))
