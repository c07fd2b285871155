"""bench/planner_variants.py: planner runs side by side, against static-peak and the
instant follower at each report's own margin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from planner_variants import _follower, _labelled, table


def _report(hours: float, follower: float) -> dict[str, Any]:
    cell = {
        "arm": "planner",
        "shape": "diurnal",
        "startup_s": 60.0,
        "attainment": 0.995,
        "replica_hours": hours,
        "scale_events_per_hour": 40.0,
        "max_replicas": 23,
        "num_refused": 30,
        "num_requests": 1000,
        "decisions": [[30.0, 5, "ForecastLoad"]],
    }
    static = dict(cell, arm="static-peak", replica_hours=12.0)  # not a planner row
    durations_s = {"diurnal": 2400.0, "step": 1800.0, "trace": 1200.0}
    return {"follower_replica_hours": {"diurnal": follower}, "cells": [cell, static],
            "config": {"peak_rate_per_s": 200.0, "durations_s": durations_s}}  # fmt: skip


def test_rows_compare_with_static_peak_and_the_reports_own_follower() -> None:
    out = table([("a", _report(9.0, 8.0)), ("b", _report(10.0, 8.0))], {"diurnal": 12.0})
    rows = out.splitlines()[2:]
    assert rows == [
        "| a | diurnal | 60 s | 99.5% | 9.00 | 0.75x | 1.12x | 40.0 | 23 | 3.0% |",
        "| b | diurnal | 60 s | 99.5% | 10.00 | 0.83x | 1.25x | 40.0 | 23 | 3.0% |",
    ]
    # Without static-peak's hours for the shape the ratio is "-", not a made-up number.
    assert "| 9.00 | - | 1.12x |" in table([("a", _report(9.0, 8.0))], {})


def test_the_follower_peaks_at_the_pooled_margin() -> None:
    # 200 requests/s are 18.65 shares: 18.65 + 0.25 x sqrt(4 x 18.65) = 20.8 -> 21.
    minutes, replicas = _follower(_report(1, 1)["config"], "diurnal")
    assert max(replicas) == 21 and minutes[-1] == 40.0
    assert replicas[0] < 8  # the night: 20 % of the peak


def test_a_report_needs_a_label(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report(1, 1)))
    assert _labelled([f"x=y={path}"])[0][0] == "x=y"
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        _labelled([str(path)])
