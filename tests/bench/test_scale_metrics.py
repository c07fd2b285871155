"""bench/scale_metrics.py: percentiles from the router's decision histogram (exact about
the bucket, linear inside it), windows between scrapes, and the trend of a series."""

from __future__ import annotations

import math

import pytest
from scale_metrics import Histogram, parse_gauge, parse_histogram, trend

# What prometheus_client writes for 100 decisions: 40 <= 0.25 ms, 50 more <= 0.5 ms, 8 more
# <= 1 ms, 1 <= 2.5 ms, 1 <= 100 ms.
TEXT = """# HELP kvflow_router_routing_decision_seconds Time to choose a worker
# TYPE kvflow_router_routing_decision_seconds histogram
kvflow_router_routing_decision_seconds_bucket{le="5e-05"} 0.0
kvflow_router_routing_decision_seconds_bucket{le="0.0001"} 0.0
kvflow_router_routing_decision_seconds_bucket{le="0.00025"} 40.0
kvflow_router_routing_decision_seconds_bucket{le="0.0005"} 90.0
kvflow_router_routing_decision_seconds_bucket{le="0.001"} 98.0
kvflow_router_routing_decision_seconds_bucket{le="0.0025"} 99.0
kvflow_router_routing_decision_seconds_bucket{le="0.005"} 99.0
kvflow_router_routing_decision_seconds_bucket{le="0.01"} 99.0
kvflow_router_routing_decision_seconds_bucket{le="0.025"} 99.0
kvflow_router_routing_decision_seconds_bucket{le="0.1"} 100.0
kvflow_router_routing_decision_seconds_bucket{le="+Inf"} 100.0
kvflow_router_routing_decision_seconds_count 100.0
kvflow_router_routing_decision_seconds_sum 0.09
# TYPE kvflow_router_index_blocks gauge
kvflow_router_index_blocks 12345.0
"""


def test_quantiles_interpolate_inside_their_bucket() -> None:
    h = parse_histogram(TEXT)
    assert h.count == 100
    assert h.mean_s == pytest.approx(0.0009)
    # Rank 50 is the 10th of 50 in (0.25, 0.5] ms.
    assert h.quantile_s(0.5) == pytest.approx(0.00025 + 0.00025 * 10 / 50)
    # Rank 99 is the only one in (1, 2.5] ms: at the bucket's top.
    assert h.quantile_s(0.99) == pytest.approx(0.0025)
    assert h.quantile_s(0.995) == pytest.approx(0.025 + 0.075 * 0.5)
    assert h.fraction_at_most(0.001) == pytest.approx(0.98)
    assert h.fraction_at_most(0.005) == pytest.approx(0.99)


def test_a_window_is_the_difference_of_two_scrapes() -> None:
    later = parse_histogram(TEXT)
    bounds = later.bounds_s
    earlier = Histogram(bounds, tuple(min(c, 40.0) for c in later.cumulative), 0.008)
    window = later.minus(earlier)
    assert window.count == 60
    assert window.sum_s == pytest.approx(0.082)
    assert window.fraction_at_most(0.00025) == 0  # the 40 fast ones were before
    assert window.quantile_s(0.5) == pytest.approx(0.00025 + 0.00025 * 30 / 50)


def test_empty_windows_and_missing_metrics() -> None:
    h = parse_histogram(TEXT)
    empty = h.minus(h)
    assert math.isnan(empty.quantile_s(0.5)) and math.isnan(empty.fraction_at_most(0.001))
    assert parse_gauge(TEXT, "kvflow_router_index_blocks") == 12345
    with pytest.raises(ValueError, match="no histogram"):
        parse_histogram(TEXT, "kvflow_router_ttft_seconds")
    with pytest.raises(ValueError, match="no gauge"):
        parse_gauge(TEXT, "kvflow_router_workers")


def test_trend_is_a_least_squares_slope_per_minute() -> None:
    t = trend([0, 30, 60, 90], [100.0, 101.0, 102.0, 103.0])
    assert t.slope_per_min == pytest.approx(2.0)
    assert (t.first, t.last, t.peak, t.growth) == (100, 103, 103, 3)
    assert trend([0, 60], [5.0, 5.0]).slope_per_min == 0
