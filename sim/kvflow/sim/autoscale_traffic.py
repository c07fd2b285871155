"""The planner benchmark's traffic: arrival times over time, and the requests (pure, seeded).

Three shapes, each a rate per second over virtual time, scaled so its *peak* is
`peak_rate_per_s`:

- **diurnal**: a day compressed into `period_s`, a raised cosine from the trough
  (`trough_fraction` of the peak, at the start) to the peak at mid-period and back;
- **step**: 1x for the first fifth, 5x for the middle two fifths, 1x again;
- **trace**: the arrival timestamps of the Mooncake FAST'25 synthetic trace
  (`traces/mooncake-fast25/` in the repository), sped up so its mean rate is `peak_rate_per_s`;
  only the timestamps are used, the request shapes are ours.

Non-trace arrivals are a non-homogeneous Poisson process drawn by thinning (Lewis and
Shedler): candidates at the peak rate, each kept with probability rate(t) / peak.
Requests: prompt and output lengths uniform in the given ranges, no shared prefixes (the
planner is about load, not cache hits), every request its own content.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvflow.loadgen.trace import MOONCAKE_TRACE, load_trace
from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock

TRACE_PATH = MOONCAKE_TRACE

SHAPES = ("diurnal", "step", "trace")


@dataclass(frozen=True)
class Traffic:
    shape: str
    duration_s: float
    peak_rate_per_s: float
    trough_fraction: float = 0.2  # diurnal: the night's rate over the day's peak
    step_factor: float = 5.0
    input_tokens: tuple[int, int] = (256, 768)  # uniform, inclusive
    output_tokens: tuple[int, int] = (64, 192)
    trace_path: Path = TRACE_PATH

    def rate_at(self, time_s: float) -> float:
        """The offered rate at `time_s` (the trace's is its mean: it is bursty by itself)."""
        peak = self.peak_rate_per_s
        if self.shape == "diurnal":
            low = self.trough_fraction
            phase = (1 - math.cos(2 * math.pi * time_s / self.duration_s)) / 2
            return peak * (low + (1 - low) * phase)
        if self.shape == "step":
            is_high = self.duration_s / 5 <= time_s < 3 * self.duration_s / 5
            return peak if is_high else peak / self.step_factor
        if self.shape == "trace":
            return peak
        raise ValueError(f"unknown traffic shape {self.shape!r}: use one of {', '.join(SHAPES)}")

    @property
    def mean_rate_per_s(self) -> float:
        num = 1000
        return sum(self.rate_at((i + 0.5) * self.duration_s / num) for i in range(num)) / num

    @property
    def step_times_s(self) -> tuple[float, float] | None:
        """When the step goes up and back down (step only)."""
        if self.shape != "step":
            return None
        return self.duration_s / 5, 3 * self.duration_s / 5


def arrival_times_s(traffic: Traffic, rng: random.Random) -> list[float]:
    if traffic.shape == "trace":
        return trace_times_s(traffic)
    return thinned_poisson(traffic.rate_at, traffic.peak_rate_per_s, traffic.duration_s, rng)


def thinned_poisson(
    rate_at: Callable[[float], float], max_rate: float, duration_s: float, rng: random.Random
) -> list[float]:
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(max_rate)
        if t >= duration_s:
            return times
        if rng.random() * max_rate < rate_at(t):
            times.append(t)


def trace_times_s(traffic: Traffic) -> list[float]:
    """The trace's timestamps, sped up to the traffic's rate, looped to fill the duration."""
    stamps = [r.timestamp_ms / 1000 for r in load_trace(traffic.trace_path)]
    span_s = stamps[-1] - stamps[0]
    speedup = traffic.peak_rate_per_s * span_s / len(stamps)
    times: list[float] = []
    offset = 0.0
    while True:
        for s in stamps:
            t = offset + (s - stamps[0]) / speedup
            if t >= traffic.duration_s:
                return times
            times.append(t)
        offset += span_s / speedup + 1 / traffic.peak_rate_per_s


def requests_for(
    times_s: Sequence[float], traffic: Traffic, rng: random.Random, namespace: str
) -> list[tuple[BenchRequest, float]]:
    out = []
    for i, t in enumerate(times_s):
        num_in = rng.randint(*traffic.input_tokens)
        num_out = rng.randint(*traffic.output_tokens)
        block = TextBlock(key=f"{namespace}/{i}", num_words=num_in)
        request = BenchRequest(
            request_id=f"{namespace}-{i}",
            namespace=namespace,
            session_id=f"{namespace}-s{i}",
            segments=(Segment("user", (block,)),),
            num_output_tokens=num_out,
        )
        out.append((request, t))
    return out
