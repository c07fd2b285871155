"""bench/engine_ab.py: two versions of the model decode in one process and stay in step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "engine_ab.py"), *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_this_checkout_against_itself_times_both_arms_every_round(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = run("--old", str(ROOT), "--steps", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["batch"] == 1
    for arm in ("ceiling", "old", "new"):
        assert len(report["step_s"][arm]) == 3
        assert all(s > 0 for s in report["step_s"][arm])
    assert report["new_over_old"] > 0
    assert "new / old step time" in done.stdout


def test_a_folder_that_is_not_a_checkout_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    done = run("--old", str(tmp_path))
    assert done.returncode == 2
    assert "--old takes a checkout" in done.stderr
