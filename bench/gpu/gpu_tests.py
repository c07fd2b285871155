"""The tests marked ``gpu`` (bench/gpu_tests.sh's default files) inside the GPU check's
run: one setup, one JSON. pytest runs in a child process with a JUnit XML report, whose
counts, failures (with their messages) and skip reasons go into the stage's result. On a
machine without CUDA every test is skipped with its reason: the stage still shows the
files import (the device image has no ``gguf``) and collect.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log

ROOT = Path(__file__).resolve().parents[2]


def default_files() -> list[str]:
    out = subprocess.run(
        ["bash", "bench/gpu_tests.sh", "--list"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return out.stdout.split()


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts, failures and skip reasons of a pytest JUnit XML report."""
    root = ET.parse(path).getroot()
    counts: Counter[str] = Counter()
    failures: list[dict[str, str]] = []
    skips: Counter[str] = Counter()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                failures.append({"test": name, "message": (child.get("message") or "")[:500]})
            elif child.tag == "skipped":
                outcome = "skipped"
                skips[(child.get("message") or "")[:200]] += 1
        counts[outcome] += 1
    return {
        "counts": dict(counts),
        "failures": failures,
        "skip_reasons": dict(skips.most_common(5)),
    }


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    files = default_files()
    rec.set("files", files)
    with tempfile.TemporaryDirectory(prefix="gpu_tests-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *files]  # fmt: skip
        log(f"gpu_tests: {len(files)} files")
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=max(deadline.left_s() - 2, 1),
            check=False,
        )
        rec.set("exit_code", proc.returncode)
        rec.set("output_tail", proc.stdout[-2000:] + proc.stderr[-1000:])
        if not xml.exists():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode})")
        summary = junit_summary(xml)
    rec.set("summary", summary)
    log(f"gpu_tests: {summary['counts']}")
    # pytest exits 5 when every collected test was deselected: none marked gpu is a failure.
    if proc.returncode not in (0,) or summary["failures"]:
        raise RuntimeError(f"gpu tests: exit {proc.returncode}, {summary['counts']}")
