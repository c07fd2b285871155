"""The chaos soak (tests/chaos/soak.py) as tests: a short run for CI that kills every kind
of part at least once, and the long run (`soak` marker) for as long as
KVFLOW_SOAK_DURATION_S says:

    KVFLOW_SOAK_DURATION_S=1800 .venv/bin/pytest -m soak tests/chaos -s

Both assert the targets: nothing lost, duplicated, hung or answered with a 5xx other than
a clean 503 with Retry-After; no KV block leaked; usage counted exactly once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos.soak import SoakConfig, SoakReport, run_soak

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def assert_targets(report: SoakReport) -> None:
    summary = json.dumps(report.as_dict(), indent=1)
    assert not report.bad(), summary
    # The chaos really happened, and the load really ran through it.
    kinds = {name.split("-")[0] for name in report.kills}
    assert {"sim", "real", "router", "redis"} <= kinds, summary
    ok = report.verdicts.get("ok", 0)
    assert report.num_requests >= 100 and ok >= report.num_requests // 2, summary
    assert report.checkpoints >= 1, summary


def test_short_chaos_soak_loses_nothing(tmp_path: Path) -> None:
    # About 25 s of chaos: one fault every 3 s on average, the first four one of each
    # kind; with startup and the checkpoint, about 60-80 s on two busy cores.
    config = SoakConfig(duration_s=25, seed=7, mean_fault_interval_s=3.0, round_s=25,
                        max_down_s=3.0)  # fmt: skip
    assert_targets(run_soak(config, tmp_path))


@pytest.mark.soak
@pytest.mark.timeout(0)
def test_long_chaos_soak(tmp_path: Path) -> None:
    duration_s = float(os.environ.get("KVFLOW_SOAK_DURATION_S", "0"))
    if duration_s <= 0:
        pytest.skip("set KVFLOW_SOAK_DURATION_S (e.g. 1800) to run the long soak")
    seed = int(os.environ.get("KVFLOW_SOAK_SEED", "1"))
    report = run_soak(SoakConfig(duration_s=duration_s, seed=seed), tmp_path)
    out = os.environ.get("KVFLOW_SOAK_REPORT")
    if out:
        Path(out).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    assert_targets(report)
