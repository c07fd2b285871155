"""Short-horizon load forecasts: Holt's linear smoothing on irregular samples (pure).

Holt keeps a level and a trend per second. At each sample x, dt seconds after the last:

    level' = alpha x + (1 - alpha) (level + trend dt)
    trend' = beta (level' - level) / dt + (1 - beta) trend

and forecasts the last sample plus the trend over h seconds ahead, damped: a slope seen now
carries on for `damping_s` on average, so it adds trend x damping_s x (1 - exp(-h /
damping_s)), never more than trend x damping_s (Gardner and McKenzie's damped trend, in
continuous time). It beat a least-squares line over the last N samples on the benchmark's
ramps (it forgets old slopes in a few samples, a line keeps them for N), and it needs two
numbers of state, not N.

Why damped: a load rises for a while, not for ever, and the slopes the forecast trusts are
the last few intervals'. At the top of a ramp they still say "up" while the load levels
off, and a replica bought on them is held until the load has fallen well past the top. In
the virtual cluster (a diurnal at 200 requests/s, 60 s start-up, a 90 s horizon) the
undamped trend bought a 21st replica where 20 carried the peak and held it 450 s; damped at
60 s it bought 20 (docs/benchmarks.md). On a steady ramp a damped forecast buys less
ahead: the margin (`target_utilization`) and the reactive rules cover that part.

A forecast is never trusted for more than `max_growth` times the load seen now, and its
trend never for more than the median of the last five raw slopes: one noisy sample or
one step makes a steep trend for several samples, and a replica bought on it costs a
whole stabilization window. In the virtual cluster a 5x step with a 60 s start-up made
Holt's trend ask for 12 replicas where 7 carried the load; trusting it only after two
rising samples still asked for 7 where 5 did (after a jump, noise rises half the time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Raw slopes whose median bounds the trend. Of 3, a jump and one noisy rise after it made
# the median the noise (+650 prompt tokens/s in 30 s, +18 % over a 90 s horizon: 2 replicas
# too many after a 5x step); of 5, the jump and a noisy rise are both outvoted, and a ramp
# still shows after 2.5 minutes at 30 s intervals.
SLOPES = 5


@dataclass(frozen=True)
class Holt:
    """The smoothed level and trend of one load series, as of `time_s`."""

    level: float
    trend_per_s: float
    time_s: float
    last_value: float = 0.0
    # Per-second slopes between the last raw samples (newest last, at most SLOPES kept).
    slopes_per_s: tuple[float, ...] = ()

    def update(self, value: float, time_s: float, *, alpha: float, beta: float) -> Holt:
        dt = time_s - self.time_s
        if dt <= 0:  # a repeated or out-of-order sample: nothing new to learn from it
            return self
        predicted = self.level + self.trend_per_s * dt
        level = alpha * value + (1 - alpha) * predicted
        trend = beta * (level - self.level) / dt + (1 - beta) * self.trend_per_s
        slopes = (*self.slopes_per_s, (value - self.last_value) / dt)[-SLOPES:]
        return Holt(level, trend, time_s, last_value=value, slopes_per_s=slopes)

    @property
    def is_falling(self) -> bool:
        """Whether the load fell at each of the last SLOPES samples. Noise around a flat load
        makes six samples in falling order about once in 720 intervals; a decline makes
        them every interval, from 2.5 minutes into it at 30 s intervals."""
        return len(self.slopes_per_s) == SLOPES and all(s < 0 for s in self.slopes_per_s)

    def forecast(self, horizon_s: float, *, damping_s: float | None = None) -> float:
        """The last sample plus the trend `horizon_s` ahead (damped at `damping_s`; None:
        not damped), the trend at most the median of the last SLOPES raw slopes (none
        before there are that many). Holt cannot tell a jump from a ramp: after a step its
        trend, and its level, overshoot for several samples. A step is one steep slope
        among flat ones, so the median ignores it; a ramp's slopes are all alike, so the
        median keeps it."""
        if len(self.slopes_per_s) < SLOPES:
            return self.last_value
        trend = min(self.trend_per_s, statistics.median(self.slopes_per_s))
        reach_s = horizon_s if damping_s is None else damped_reach_s(horizon_s, damping_s)
        return max(0.0, self.last_value + trend * reach_s)

    def present(self, sample_window_s: float) -> float:
        """The load at this moment if it is falling: the last sample is a rate over the
        last `sample_window_s`, the load of half a window ago, and a pool sized for it holds
        a step's worth of replicas half an interval too long at every step down. The slope
        taken is the gentler of Holt's and the median raw slope, so noise does not cut
        deeper than the decline; a rise is not extrapolated (the last sample). `sizing_load`
        asks only on a decline (`is_falling`)."""
        if len(self.slopes_per_s) < SLOPES:
            return self.last_value
        slope = max(self.trend_per_s, statistics.median(self.slopes_per_s))
        return max(0.0, self.last_value + min(0.0, slope) * sample_window_s / 2)


def damped_reach_s(horizon_s: float, damping_s: float) -> float:
    """Seconds of the trend a damped forecast adds `horizon_s` ahead: the integral of
    exp(-t / damping_s) over the horizon (the horizon itself while it is short against
    `damping_s`, `damping_s` at most)."""
    if damping_s <= 0:
        raise ValueError(f"damping_s must be > 0, got {damping_s}")
    return damping_s * (1 - math.exp(-horizon_s / damping_s))


def start_or_update(
    holt: Holt | None, value: float, time_s: float, *, alpha: float, beta: float
) -> Holt:
    if holt is None:
        return Holt(level=value, trend_per_s=0.0, time_s=time_s, last_value=value)
    return holt.update(value, time_s, alpha=alpha, beta=beta)


def sizing_load(
    now: float,
    holt: Holt,
    horizon_s: float,
    *,
    max_growth: float,
    sample_window_s: float,
    damping_s: float | None = None,
) -> float:
    """The load to size for: what is coming, or what is here now, whichever is more; on a
    decline (five falls in a row), what is here at this moment (`Holt.present`): while it
    lasts, the most load of any horizon is the load now."""
    if holt.is_falling:
        return min(now, holt.present(sample_window_s))
    ahead = holt.forecast(horizon_s, damping_s=damping_s)
    return max(now, min(ahead, now * max_growth if now > 0 else 0.0))
