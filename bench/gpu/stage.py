"""One stage of the GPU check in this process: ``python -m gpu.stage NAME --plan P --out O``.

bench/gpu_check.py starts each stage this way, with ``bench/`` and the source roots on
PYTHONPATH, in a process group of its own that it kills at the stage's budget. Exit 0 when
the stage ran to its end (some parts may have recorded errors), 1 when it raised.
``KVFLOW_GPU_CHECK_FAIL=<stage>=raise,<stage>=hang`` makes a stage raise, or hang until
it is killed, at once: how the tests check that the run records a failed stage, and a stage
past its budget, and goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from gpu.plan import STAGES, Plan
from gpu.record import Deadline, Recorder, log


def _inject_fault(stage: str) -> None:
    faults = dict(
        item.partition("=")[::2]
        for item in os.environ.get("KVFLOW_GPU_CHECK_FAIL", "").split(",")
        if item
    )
    if faults.get(stage) == "raise":
        raise RuntimeError(f"injected failure (KVFLOW_GPU_CHECK_FAIL: {stage}=raise)")
    if faults.get(stage) == "hang":
        time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    args = parser.parse_args(argv)
    rec = Recorder(args.out)
    rec.set("status", "running")
    try:
        plan = Plan.from_dict(json.loads(args.plan.read_text()))
        _inject_fault(args.stage)
        log(f"stage {args.stage}: budget {args.budget_s:.0f} s")
        module = importlib.import_module(f"gpu.{args.stage}")
        module.run(plan, rec, Deadline(args.budget_s))
    except Exception as exc:  # the stage's boundary: record why, the parent goes on
        rec.data["error"] = f"{type(exc).__name__}: {exc}"
        rec.data["traceback"] = traceback.format_exc()[-4000:]
        rec.set("status", "error")
        print(rec.data["traceback"], file=sys.stderr, flush=True)
        return 1
    rec.set("status", "partial" if rec.data.get("errors") else "ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
