"""The scale check's arithmetic, pure: the router's decision histogram read from its
/metrics text, percentiles between bucket bounds, and whether a series stayed flat.

The router times each routing decision itself (``kvflow_router_routing_decision_seconds``,
``GenerationService._plan``: the worker views, lazy block hashing, index lookup, filters,
scorers, picker) into a histogram with bounds at 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25,
100 ms. A percentile from it is exact about which bucket it falls in and interpolated
linearly inside the bucket, so "P50 < 1 ms" and "P99 < 5 ms" (bucket bounds) are checked
exactly from the counts, and the printed value is an estimate within its bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DECISION_METRIC = "kvflow_router_routing_decision_seconds"
INDEX_METRIC = "kvflow_router_index_blocks"


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts at each upper bound (seconds), the last one +Inf; sum in seconds."""

    bounds_s: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum_s: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (a window)."""
        assert self.bounds_s == earlier.bounds_s, "histograms with different buckets"
        return Histogram(
            self.bounds_s,
            tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            self.sum_s - earlier.sum_s,
        )

    def fraction_at_most(self, bound_s: float) -> float:
        """The share of observations <= ``bound_s``, which must be a bucket bound."""
        if not self.count:
            return math.nan
        return self.cumulative[self.bounds_s.index(bound_s)] / self.count

    def quantile_s(self, q: float) -> float:
        """Linear interpolation inside the bucket holding the q-quantile (0 < q < 1). A
        quantile in the +Inf bucket is reported as the last finite bound."""
        if not self.count:
            return math.nan
        rank = q * self.count
        lower_s, below = 0.0, 0.0
        for bound_s, cumulative in zip(self.bounds_s, self.cumulative, strict=True):
            if cumulative >= rank:
                if math.isinf(bound_s):
                    return lower_s
                inside = cumulative - below
                return lower_s + (bound_s - lower_s) * ((rank - below) / inside if inside else 0)
            lower_s, below = bound_s, cumulative
        return lower_s

    @property
    def mean_s(self) -> float:
        return self.sum_s / self.count if self.count else math.nan


def _value_of(line: str) -> float:
    return float(line.rsplit(" ", 1)[1])


def parse_histogram(text: str, name: str = DECISION_METRIC) -> Histogram:
    """One unlabelled histogram from Prometheus text exposition."""
    bounds: list[float] = []
    cumulative: list[float] = []
    sum_s = math.nan
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bounds.append(math.inf if le == "+Inf" else float(le))
            cumulative.append(_value_of(line))
        elif line.startswith(f"{name}_sum "):
            sum_s = _value_of(line)
    if not bounds:
        raise ValueError(f"no histogram {name} in the metrics text")
    return Histogram(tuple(bounds), tuple(cumulative), sum_s)


def parse_gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return _value_of(line)
    raise ValueError(f"no gauge {name} in the metrics text")


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (t, y) samples, and how much the series moved."""

    slope_per_min: float
    first: float
    last: float
    peak: float

    @property
    def growth(self) -> float:
        return self.last - self.first


def trend(times_s: Sequence[float], values: Sequence[float]) -> Trend:
    assert len(times_s) == len(values) >= 2, "a trend needs two samples"
    n = len(times_s)
    mean_t, mean_y = sum(times_s) / n, sum(values) / n
    var_t = sum((t - mean_t) ** 2 for t in times_s)
    cov = sum((t - mean_t) * (y - mean_y) for t, y in zip(times_s, values, strict=True))
    slope_per_s = cov / var_t if var_t else 0.0
    return Trend(slope_per_s * 60, values[0], values[-1], max(values))
