"""The GPU check: the engine on a GPU against transformers and the device's rooflines.

    bench/gpu_check.sh [--device auto|cuda|cpu] [--dry-run] [--size full|small|tiny]
                       [--json PATH] [--stages a,b] [--stage-budget NAME=SECONDS] [--strict]

Each stage runs in a process of its own with a time budget (gpu/plan.py, STAGES and
budgets_s): env (versions, a device copy's bandwidth, the bf16 matrix rate), gpu_tests
(the tests marked gpu, bench/gpu_tests.sh's files), parity (greedy tokens and logits
against transformers, CUDA graphs on and off), roofline (batch-1 decode against the HBM
roofline, 8B and the 70B layer slice), prefill (an 8K prompt against the bf16 compute
roofline), throughput (batch 8/64/256 against transformers' continuous batching), quant
(FP8 weights and FP8 KV cache), profile (``kvflow profile``'s sweep and fit, written as a
profile file beside the JSON) and kv_transfer. A stage that fails, crashes or outlives its
budget is recorded (with whatever it measured before) and the next one runs. One JSON
(``$OUT/gpu_check.json`` when $OUT is set), one table.
``--dry-run`` is ``--device cpu``: the tiny plan, every stage, under a minute on a CPU, so
the script is exercised in CI (tests/bench/test_gpu_check.py). docs/benchmarks.md, "GPU
check", says how to run it on the device machine and what it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu.plan import STAGES, make_plan  # noqa: E402
from gpu.report import summarize, table  # noqa: E402

# The whole run's ceiling: the device session allows 8 minutes (480 s) for the script;
# setup takes ~20 s of it and the machine's start is not counted, so 430 s of stages keeps
# half a minute of margin. Stages get what is left when their budget would overrun it; a
# stage killed at its budget keeps what it measured.
TOTAL_BUDGET_S = {"full": 430.0, "small": 420.0, "tiny": 600.0}
# A stage is told its budget minus this, so it winds down before it is killed.
WIND_DOWN_S = 3.0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    roots = [str(ROOT / p) for p in ("bench", "proto", "engine_worker")]
    env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in [env.get("PYTHONPATH")] if p])
    # Nothing outside the machine is reachable on the device: fail fast, never wait on a hub.
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    return env


def cuda_available(env: dict[str, str]) -> bool:
    probe = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return out.stdout.strip() == "True"


def run_stage(
    name: str,
    plan_path: Path,
    work: Path,
    budget_s: float,
    env: dict[str, str],
    in_process: bool = False,
) -> dict[str, Any]:
    """One stage in a process of its own, killed at its budget; ``in_process``: in this
    one, stopped only by its own checks of its deadline (the CPU mode: each stage's process
    would spend seconds of CPU importing torch and transformers again)."""
    out = work / f"{name}.json"
    started = time.monotonic()
    args = [name, "--plan", str(plan_path), "--out", str(out),
            "--budget-s", str(max(budget_s - WIND_DOWN_S, 1.0))]  # fmt: skip
    timed_out = False
    if in_process:
        from gpu import stage

        returncode = stage.main(args)
    else:
        # A session of its own: at the budget the whole group goes (its peer processes too).
        cmd = [sys.executable, "-m", "gpu.stage", *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        returncode = proc.returncode
    result: dict[str, Any] = {}
    if out.exists():
        result = json.loads(out.read_text())
    status = result.get("status", "no result")
    if timed_out:
        status = "timeout"
    elif returncode != 0 and status not in ("error",):
        status = f"crashed (exit {returncode})"
    return {
        "status": status,
        "wall_s": time.monotonic() - started,
        "budget_s": budget_s,
        "result": result,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--dry-run", action="store_true", help="same as --device cpu")
    parser.add_argument(
        "--size", choices=["full", "small", "tiny"], help="default: full on CUDA, tiny on CPU"
    )
    parser.add_argument("--json", type=Path, help="default: $OUT/gpu_check.json, else /tmp")
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--stage-budget", action="append", default=[], metavar="NAME=SECONDS")
    parser.add_argument("--total-budget-s", type=float)
    parser.add_argument("--setup-s", type=float, help="(from gpu_check.sh) setup time")
    parser.add_argument(
        "--isolate",
        choices=["auto", "yes", "no"],
        default="auto",
        help="each stage in a process of its own, killed at its budget (auto: yes but on "
        "the CPU's tiny plan, whose stages run in this process)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 unless every stage is ok and parity passed"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    env = child_env()
    device = "cpu" if args.dry_run else args.device
    if device == "auto":
        device = "cuda" if cuda_available(env) else "cpu"
    size = args.size or ("full" if device == "cuda" else "tiny")
    plan = make_plan(size, device)
    for item in args.stage_budget:
        name, _, seconds = item.partition("=")
        if name not in STAGES:
            raise SystemExit(
                f"--stage-budget {item}: no stage {name!r}; stages: {', '.join(STAGES)}"
            )
        plan.budgets_s[name] = float(seconds)
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"--stages: unknown {sorted(unknown)}; stages: {', '.join(STAGES)}")
    total_s = args.total_budget_s or TOTAL_BUDGET_S[size]
    in_process = args.isolate == "no" or (args.isolate == "auto" and size == "tiny")
    if in_process:
        os.environ.update(env)  # what each stage's process would have had
    json_path = args.json or Path(os.environ.get("OUT") or tempfile.gettempdir()) / "gpu_check.json"
    report: dict[str, Any] = {
        "meta": {
            "command": " ".join(
                ["bench/gpu_check.sh", *(argv if argv is not None else sys.argv[1:])]
            ),
            "device": device,
            "size": size,
            "host": platform.node(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "setup_s": args.setup_s,
            "total_budget_s": total_s,
            "stages_in_process": in_process,
        },
        "plan": plan.to_dict(),
        "stages": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        plan_path = work / "plan.json"
        plan_path.write_text(json.dumps(plan.to_dict()))
        for name in stages:
            left = total_s - (time.monotonic() - started)
            if left - 2 < 5:
                report["stages"][name] = {"status": "skipped (total budget spent)", "result": {}}
                continue
            budget = min(plan.budgets_s[name], left - 2)
            print(f"[gpu_check] stage {name}: budget {budget:.0f} s", flush=True)
            report["stages"][name] = run_stage(name, plan_path, work, budget, env, in_process)
            print(
                f"[gpu_check] stage {name}: {report['stages'][name]['status']} "
                f"in {report['stages'][name]['wall_s']:.1f} s",
                flush=True,
            )
            report["meta"]["wall_s"] = time.monotonic() - started
            report["summary"] = summarize(report)
            _write(json_path, report)  # after every stage: a killed run keeps the rest
    report["meta"]["wall_s"] = time.monotonic() - started
    report["summary"] = summarize(report)
    profile = _profile_file(report, json_path)
    if profile is not None:
        report["meta"]["profile_file"] = str(profile)
    _write(json_path, report)
    print()
    print(table(report))
    print(f"\nwrote {json_path}")
    if args.strict:
        s = report["summary"]
        ok = not s["stages_not_ok"] and all(v is True for v in s["parity_passed"].values())
        return 0 if ok else 1
    return 0


def _profile_file(report: dict[str, Any], json_path: Path) -> Path | None:
    """The measured simulator profile as a file of its own beside the JSON (the schema
    ``kvflow sim --profile`` and ``kvflow plan --profile`` read)."""
    stage = report["stages"].get("profile") or {}
    profile = (stage.get("result") or {}).get("profile")
    if not profile:
        return None
    path = json_path.with_name(f"profile-{profile['name']}.json")
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
