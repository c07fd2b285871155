"""`kvflow sim compare --plot-from`: several runs' JSON reports, merged into one plot."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.cli.sim import main
from kvflow.sim.plots import PlotError, merged_ladders

CONFIG = {"profile": "h100-llama3-8b", "num_workers": 8, "num_kv_blocks": None,
          "slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "seed": 0, "quick": False}  # fmt: skip


def point(qps: float, ttft_p90_s: float, hit_rate: float) -> dict[str, Any]:
    return {"qps": qps, "latency": {"ttft_p90_with_failures_s": ttft_p90_s},
            "cache": {"hit_rate": hit_rate}}  # fmt: skip


def report(arm: str, *points: dict[str, Any], workload: str = "shared-prefix") -> dict[str, Any]:
    ladder = {"workload": workload, "arm": arm, "load_points": list(points)}
    return {"config": dict(CONFIG, arms=[arm]), "ladders": [ladder]}


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    code = main(["compare", *argv], io.StringIO(), err)
    return code, err.getvalue()


def test_reports_merge_by_workload_and_arm_the_later_one_winning() -> None:
    old = report("kvflow", point(10, 0.05, 0.8))
    baseline = report("round-robin", point(10, 0.5, 0.2))
    new = report("kvflow", point(10, 0.04, 0.9))
    other = report("kvflow", point(5, 0.1, 0.0), workload="no-reuse")
    merged = merged_ladders([old, baseline, new, other])
    expected = {"kvflow": new, "round-robin": baseline}
    assert merged["shared-prefix"] == {
        a: r["ladders"][0]["load_points"] for a, r in expected.items()
    }
    assert list(merged["no-reuse"]) == ["kvflow"]


def test_reports_from_different_setups_are_refused() -> None:
    smaller = copy.deepcopy(report("round-robin", point(10, 0.5, 0.2)))
    smaller["config"]["num_workers"] = 4
    with pytest.raises(PlotError, match="different setups"):
        merged_ladders([report("kvflow", point(10, 0.05, 0.8)), smaller])


def test_plot_from_writes_one_png(tmp_path: Path) -> None:
    paths = []
    for arm in ("kvflow", "least-loaded"):
        path = tmp_path / f"{arm}.json"
        path.write_text(json.dumps(report(arm, point(10, 0.05, 0.8), point(20, 2.0, 0.7))))
        paths.append(str(path))
    png = tmp_path / "merged.png"
    code, err = run(["--plot-from", *paths, "--plot", str(png)])
    assert code == 0, err
    assert png.stat().st_size > 10_000


def test_plot_from_bad_input_exits_2_with_the_reason(tmp_path: Path) -> None:
    code, err = run(["--plot-from", str(tmp_path / "none.json"), "--plot", "x.png"])
    assert code == 2 and "none.json" in err
    not_report = tmp_path / "list.json"
    not_report.write_text("[1, 2]")
    code, err = run(["--plot-from", str(not_report), "--plot", str(tmp_path / "x.png")])
    assert code == 2 and "not a `kvflow sim compare --json` report" in err
    code, err = run(["--plot-from", str(not_report)])
    assert code == 2 and "needs --plot" in err
