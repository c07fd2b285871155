"""bench/kv_transfer.py --quick end to end: two real peer processes move Llama-3-8B-shaped
KV over TCP and gloo, and the JSON it writes is complete and self-consistent. Speed is
not asserted (a benchmark is not a test); that the bytes landed in the right blocks is."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BYTES_PER_TOKEN = 128 * 1024  # Llama-3-8B in bf16: 32 layers x 8 heads x 128 x 2 x 2 B
QUICK_TOKENS = (1024, 4096)
QUICK_REPS = 3


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kv") / "kv.json"
    proc = subprocess.run(
        [sys.executable, "bench/kv_transfer.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| tokens | MiB | transport |" in proc.stdout
    return dict(json.loads(out.read_text()))


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_every_size_and_transport_has_a_row(report: dict[str, Any]) -> None:
    rows = {(r["tokens"], r["transport"]): r for r in report["results"]}
    assert set(rows) == {(t, k) for t in QUICK_TOKENS for k in ("tcp", "gloo")}
    for (tokens, transport), r in rows.items():
        assert r["num_bytes"] == tokens * BYTES_PER_TOKEN
        for key in ("kvflow_gbps", "ceiling_gbps", "raw_gloo_gbps", "raw_socket_gbps", "ratio"):
            assert _positive(r[key]), (key, r[key])
        assert r["ratio"] == pytest.approx(r["kvflow_gbps"] / r["ceiling_gbps"])
        # The ceiling is the better raw arm (TCP's own: the socket blast).
        best = max(r["raw_gloo_gbps"], r["raw_socket_gbps"])
        assert r["ceiling_gbps"] == (r["raw_socket_gbps"] if transport == "tcp" else best)
        assert len(r["samples"]) == QUICK_REPS
        for s in r["samples"]:
            # The three phases tile the end-to-end time (gather, then send, then scatter).
            parts = s["gather_s"] + s["send_s"] + s["scatter_s"]
            assert all(s[k] > 0 for k in ("gather_s", "send_s", "scatter_s"))
            assert parts == pytest.approx(s["total_s"], rel=1e-6)
        assert r["kvflow_gbps"] == pytest.approx(
            r["num_bytes"] / r["total_s_median"] / 1e9, rel=1e-9
        )


def test_the_blocks_landed_where_they_belong(report: dict[str, Any]) -> None:
    assert report["verified"] == {"kvflow-tcp/1024": True, "kvflow-gloo/1024": True}


def test_setup_targets_and_machine_are_reported(report: dict[str, Any]) -> None:
    for transport in ("tcp", "gloo"):
        setup = report["setup"][transport]
        assert _positive(setup["first_transfer_ms"])
        assert _positive(setup["per_transfer_ms_median"])
        assert len(setup["per_transfer_ms"]) >= 10
        assert isinstance(report["targets"]["setup_met"][transport], bool)
        assert isinstance(report["targets"]["ratio_met"][transport], bool)
    assert report["quick"] is True and report["repetitions"] == QUICK_REPS
    assert report["kv"]["bytes_per_token"] == BYTES_PER_TOKEN
    assert len(report["machine"]["load_average_start"]) == 3
    assert report["command"].startswith("python bench/kv_transfer.py --quick")
