"""bench/gateway_overhead.py end to end, shortened: the direct arm, the tenant + real
redis-server arm and its instrumented re-run. Speed is not asserted (a benchmark is not a
test); that each arm ran what it says, and that the stage timers cover exactly the measured
requests, is."""

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
    out = tmp_path_factory.mktemp("gw") / "gw.json"
    proc = subprocess.run(
        [sys.executable, "bench/gateway_overhead.py", "--quick", "--workers", "2",
         "--arms", "tenants-redis", "--stages", "--rate", "50", "--duration-s", "2",
         "--throughput-s", "1", "--json", str(out)],
        cwd=ROOT, check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "where the time goes" in proc.stdout
    return dict(json.loads(out.read_text()))


def test_every_arm_ran_without_errors(report: dict[str, Any]) -> None:
    arms = report["arms"]
    assert list(arms) == ["direct", "tenants-redis", "tenants-redis (instrumented)",
                          "direct (again)"]  # fmt: skip
    for name, arm in arms.items():
        assert arm["num_errors"] == 0, name
        assert arm["latency"]["n"] > 0, name
    # The direct arms ran with no gateway: no gateway CPU is charged to them.
    assert set(arms["direct"]["cpu_ms_per_request"]) == {"stubs", "load_generator"}
    assert set(report["added_ms"]) == {"tenants-redis", "tenants-redis (instrumented)"}


def test_the_tenant_arm_kept_its_quotas_in_redis(report: dict[str, Any]) -> None:
    arm = report["arms"]["tenants-redis"]
    assert arm["cpu_ms_per_request"]["redis"] > 0
    usage = arm["usage"]
    assert usage["tenant"] == "bench" and usage["scope"] == "cluster"
    # Warm-up, latency run, closed loop, target-rate check: every request was settled.
    assert usage["requests"] >= arm["latency"]["n"] + arm["target_rate_check"]["latency"]["n"]


def test_stage_times_cover_exactly_the_measured_requests(report: dict[str, Any]) -> None:
    stages = report["stages"]
    n = report["arms"]["tenants-redis (instrumented)"]["latency"]["n"]
    for stage in ("handler", "template_and_tokenize", "quota_admit", "routing_decision",
                  "worker_stream", "quota_settle"):  # fmt: skip
        assert stages[stage]["n"] == n, stage
        assert 0 < stages[stage]["p50_ms"] <= stages[stage]["p99_ms"]
    assert stages["routing_decision"]["p50_ms"] < stages["handler"]["p50_ms"]


def test_the_paired_part_measures_each_endpoint(tmp_path: Path) -> None:
    out = tmp_path / "paired.json"
    proc = subprocess.run(
        [sys.executable, "bench/gateway_overhead.py", "--quick", "--workers", "2",
         "--paired-only", "--arms", "open", "--endpoints", "chat,responses",
         "--paired-idle", "20", "--rate", "20", "--duration-s", "1", "--json", str(out)],
        cwd=ROOT, check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paired = json.loads(out.read_text())["paired"]
    assert list(paired) == ["open", "open /v1/responses"]
    for name, row in paired.items():
        assert row["loaded_errors"] == 0, name
        assert row["idle_added"]["n"] == 20 and row["loaded_added"]["n"] > 0, name
