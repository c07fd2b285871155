"""Percentiles and SLO violation shares from bucketed histograms (pure).

Both interpolate linearly inside a bucket, as Prometheus' `histogram_quantile` does: with
the workers' buckets (0.1, 0.15, 0.2 s ... around a 100 ms TPOT target) the error is at
most one bucket's width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvflow.operator.observe.exposition import Histogram


def total(histograms: Iterable[Histogram]) -> Histogram | None:
    """The sum of several targets' histograms of one family (None: none, or mixed buckets)."""
    out: Histogram | None = None
    for h in histograms:
        if out is not None and out.bounds != h.bounds:
            return None
        out = h if out is None else out + h
    return out


def quantile(h: Histogram | None, q: float) -> float | None:
    """The q-quantile (0 < q < 1) of what `h` counted; None when it counted nothing."""
    assert 0 < q < 1, q
    if h is None or h.count <= 0:
        return None
    rank = q * h.count
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in zip(h.bounds, h.cumulative, strict=True):
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound is all we know
            share = (rank - lower_count) / (cumulative - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, cumulative
    return lower_bound


def share_above(h: Histogram | None, threshold: float) -> float | None:
    """The share of observations above `threshold` (0..1); None when it counted nothing."""
    if h is None or h.count <= 0:
        return None
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in zip(h.bounds, h.cumulative, strict=True):
        if threshold <= bound:
            if math.isinf(bound):
                below = lower_count
            else:
                share = (threshold - lower_bound) / (bound - lower_bound)
                below = lower_count + (cumulative - lower_count) * share
            return max(0.0, min(1.0, 1.0 - below / h.count))
        lower_bound, lower_count = bound, cumulative
    return 0.0


def mean(h: Histogram | None) -> float | None:
    if h is None or h.count <= 0:
        return None
    return h.sum / h.count
