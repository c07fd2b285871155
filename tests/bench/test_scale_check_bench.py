"""bench/scale_check.py end to end, shrunk to 4 simulated workers on 2 host processes for a
few seconds: the router's own decision histogram is read, the KV index is compared with
the workers' caches, and the instrumented gateway times the same decisions. Speed and the
targets are not asserted (a benchmark is not a test); that the numbers are consistent is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    proc = subprocess.run(
        [sys.executable, "bench/scale_check.py", "--workers", "4", "--hosts", "2",
         "--rate", "8", "--groups", "4", "--duration-s", "4", "--warmup-s", "2",
         "--sample-s", "2", "--instrumented", "--json", str(out)],
        cwd=ROOT, check=False, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "targets:" in proc.stdout
    return dict(json.loads(out.read_text()))


def test_decisions_are_the_routers_own_and_match_the_requests(report: dict[str, Any]) -> None:
    d = report["decision"]
    assert d["num_decisions"] > 0
    assert 0 < d["p50_ms"] <= d["p99_ms"]
    assert 0 <= d["share_at_most_1ms"] <= d["share_at_most_5ms"] <= 1
    # One decision per request; the instrumented gateway timed the same ones (it forgets
    # the warm-up's when the script marks its end, a request or two apart).
    assert abs(report["stages"]["routing_decision"]["n"] - d["num_decisions"]) <= 3
    assert not report["traffic"]["errors"]


def test_the_index_follows_the_workers_caches(report: dict[str, Any]) -> None:
    samples = report["samples"]
    assert len(samples) >= 4
    capacity = report["index"]["capacity_blocks"]
    assert all(s["worker_cached_blocks"] <= capacity for s in samples)
    # After the traffic: distinct hashes in the index, at most what the workers hold.
    last = samples[-1]
    assert 0 < last["index_blocks"] <= last["worker_cached_blocks"]
    assert last["gateway_rss_mib"] > 0
