"""The JSON report: the configuration, the SLO, every load point in full, and the knee.

Times are seconds and rates per second, as the field names say; ``null`` is "not
measured" (no successful request, a server that does not report a count).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.summary import LoadPointSummary, knee

SCHEMA = "kvflow-bench/1"


def point_dict(point: LoadPointSummary) -> dict[str, Any]:
    return {**asdict(point), "qps": point.qps}


def report_dict(
    points: Sequence[LoadPointSummary], slo: Slo, config: Mapping[str, Any]
) -> dict[str, Any]:
    best = knee(points)
    return {
        "schema": SCHEMA,
        "config": dict(config),
        "slo": asdict(slo),
        "load_points": [point_dict(p) for p in points],
        "knee": None if best is None else {"label": best.label, "qps": best.qps},
    }


def write_json(path: str | Path, report: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a NaN or infinity here is a bug upstream, not a number to publish.
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
