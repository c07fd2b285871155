"""What prefill/decode disaggregation buys on real workers (issue 7, "Benchmarks").

SmolLM2-135M on this machine's CPU, the same two worker processes per arm, each on one
torch thread, a real `kvflow router` in front, real processes on loopback. Arms, in one
invocation, with the same seed and traffic (``pd_real_traffic``):

  colocated     two `colocated` workers;
  always-pd     one prefill + one decode worker, `min_remote_prefill_tokens: 16`
                (every prompt of more than one block goes to the prefill worker);
  policy        one prefill + one decode worker, the router's default config;
  policy-<T>    the same with `min_remote_prefill_tokens: T` (``--policy-thresholds``).

``--transfer-timeout-s`` sets `transfer_timeout_s` in every PD arm (the router's default
was 10 s until the runs in docs/benchmarks.md showed it shorter than a long prompt's
prefill on a prefill worker that gets half a core here; it is 30 s since).
Each arm runs at every ``--stream-rates`` value.

Runs alternate the arms' order (ABC, CBA, ...) to balance drift in the machine's load;
each run records the load average, the CPU seconds of every process and of other jobs,
and is marked invalid when the load generator could not keep its schedule. Before the
arms, a sweep of single prompts on the idle prefill + decode pair (``pd_real_threshold``).

    python bench/pd_real.py [--quick] [--json PATH] [--model PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))
sys.path.insert(0, str(ROOT))

from pd_real_pool import MODEL_NAME, WORKER_ENV, Arm, running_pool  # noqa: E402
from pd_real_report import aggregate, print_report  # noqa: E402
from pd_real_run import run_arm  # noqa: E402
from pd_real_threshold import LOCAL_GATEWAY, PD_GATEWAY, sweep  # noqa: E402
from pd_real_traffic import Traffic  # noqa: E402

from kvflow.loadgen.records import RequestRecord  # noqa: E402
from kvflow.loadgen.summary import ScheduleLimits  # noqa: E402
from kvflow.router.routing.placement import DEFAULT_MIN_REMOTE_PREFILL_TOKENS  # noqa: E402

SCHEMA = "kvflow-pd-real/1"
_T0_S = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _T0_S:6.1f} s] {message}", file=sys.stderr, flush=True)


# SmolLM2 on one thread here (calibrated under other jobs' load, 2026-11-30): a decode step
# of 4-8 streams takes 0.17-0.25 s, so one decode worker tops out near 30-35 tok/s; a
# 1,000-token prompt takes about 4 s to prefill. 0.2 streams/s of 128 tokens (26 tok/s)
# keeps a lone decode worker busy but below that; 0.35/s (45 tok/s) is more than one
# decode worker can do and within what two colocated workers can (the regime where PD's
# halved decode capacity should lose). One long prompt per 10 s keeps a prefill worker
# about half busy.
FULL = Traffic(stream_rate_per_s=0.2, stream_prompt_tokens=(24, 64), stream_output_tokens=128,
               long_interval_s=10.0, long_prompt_tokens=(600, 1500), long_output_tokens=8,
               warmup_s=15.0, measure_s=60.0, cooldown_s=60.0)  # fmt: skip
FULL_STREAM_RATES = (0.2, 0.35)
QUICK = replace(FULL, stream_rate_per_s=0.5, stream_output_tokens=32, long_interval_s=6.0,
                long_prompt_tokens=(600, 900), warmup_s=2.0, measure_s=10.0,
                cooldown_s=3.0)  # fmt: skip
# TTFTs here are seconds and ITLs hundreds of ms, so a send 50 ms late changes no number
# that matters; later than that, the client (sharing the 2 cores) was falling behind.
LIMITS = ScheduleLimits(max_lag_s=0.050)
THRESHOLD_SIZES = (64, 128, 256, 512, 1024)
# Single requests move by 50-100 ms between repetitions under other jobs' load; a median
# of three keeps one unlucky sample out.
SWEEP_REPETITIONS = 3


def arms_for(policy_thresholds: Sequence[int], transfer_timeout_s: float | None) -> list[Arm]:
    """The arms; ``transfer_timeout_s`` goes into every PD arm's config when given."""
    pair = ("prefill", "decode")
    extra = {} if transfer_timeout_s is None else {"transfer_timeout_s": transfer_timeout_s}
    arms = [
        Arm("colocated", ("colocated-0", "colocated-1")),
        Arm("always-pd", pair, {"min_remote_prefill_tokens": 16, **extra}),
        Arm("policy", pair, extra or None),
    ]
    arms += [Arm(f"policy-{t}", pair, {"min_remote_prefill_tokens": t, **extra})
             for t in policy_thresholds]  # fmt: skip
    return arms


SWEEP_ARMS = [Arm(LOCAL_GATEWAY, ("prefill", "decode"), {"enabled": False})]


def _git_commit() -> str | None:
    """HEAD, with ``+dirty`` when the tree has changes (the workers run this tree)."""
    try:

        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                                  text=True).stdout.strip()  # fmt: skip

        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def _of_rate(
    runs: Sequence[dict[str, Any]], records: Sequence[list[RequestRecord]], rate: float
) -> tuple[list[dict[str, Any]], list[list[RequestRecord]]]:
    picked = [i for i, r in enumerate(runs) if r["stream_rate_per_s"] == rate]
    return [runs[i] for i in picked], [records[i] for i in picked]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one short repetition (a smoke run)")
    p.add_argument("--json", type=Path, help="write the whole report here")
    p.add_argument("--model", help="worker model (default: the built-in SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repetitions", type=int, help="runs per arm (default 2; --quick 1)")
    p.add_argument(
        "--stream-rates",
        help="streams per second, comma-separated "
        f"(default {','.join(map(str, FULL_STREAM_RATES))}; --quick 0.5)",
    )
    p.add_argument(
        "--policy-thresholds",
        default="",
        help="extra policy arms: min_remote_prefill_tokens values, comma-separated",
    )
    p.add_argument(
        "--kv-transport",
        default="tcp",
        choices=["gloo", "tcp"],
        help="tcp by default, as in the documented runs (gloo took 4.5 s for 17-23 MB here "
        "before commit 2e85426; 13-46 ms since, as tcp)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        help="disaggregation.transfer_timeout_s of every PD arm (default: the router's)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the threshold sweep")
    p.add_argument(
        "--measure-s", type=float, help="measured arrivals per run (default: 60, quick 10)"
    )
    args = p.parse_args(argv)

    traffic = QUICK if args.quick else FULL
    if args.measure_s is not None:
        traffic = replace(traffic, measure_s=args.measure_s)
    repetitions = args.repetitions or (1 if args.quick else 2)
    if args.stream_rates:
        rates = [float(x) for x in args.stream_rates.split(",") if x]
    else:
        rates = [traffic.stream_rate_per_s] if args.quick else list(FULL_STREAM_RATES)
    traffics = [replace(traffic, stream_rate_per_s=r) for r in rates]
    thresholds = [int(x) for x in args.policy_thresholds.split(",") if x]
    arms = arms_for(thresholds, args.transfer_timeout_s)
    sizes = (64, 512) if args.quick else THRESHOLD_SIZES
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "started_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {
            "quick": args.quick,
            "seed": args.seed,
            "repetitions": repetitions,
            "model": args.model or "SmolLM2-135M-Instruct (built-in)",
            "kv_transport": args.kv_transport,
            "kv_cache_gib": args.kv_cache_gib,
            "traffic": asdict(traffic),
            "stream_rates_per_s": rates,
            "schedule_limits": asdict(LIMITS),
            "arms": [asdict(a) for a in arms],
            "router_default_min_remote_prefill_tokens": DEFAULT_MIN_REMOTE_PREFILL_TOKENS,
            "worker_env": WORKER_ENV,
            "git_commit": _git_commit(),
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_at_start": load_at_start,
        },
    }
    log("starting 4 workers and a gateway per arm")
    with running_pool([*arms, *SWEEP_ARMS], model=args.model, kv_cache_gib=args.kv_cache_gib,
                      kv_transport=args.kv_transport) as pool:  # fmt: skip
        if not args.no_sweep:
            assert PD_GATEWAY in pool.gateways
            log(f"threshold sweep: prompts of {sizes} tokens, one at a time")
            num_sweeps = 1 if args.quick else SWEEP_REPETITIONS
            report["threshold_sweep"] = sweep(pool, sizes, num_sweeps, MODEL_NAME)
        log("arms")
        runs: list[dict[str, Any]] = []
        records: list[list[RequestRecord]] = []
        for rep in range(repetitions):
            for i, load in enumerate(traffics):
                # ABC, CBA, ...: a linear drift in the machine's load evens out.
                order = arms if (rep * len(traffics) + i) % 2 == 0 else arms[::-1]
                for arm in order:
                    run, run_records = run_arm(pool, arm, load, args.seed, rep, LIMITS)
                    runs.append(run)
                    records.append(run_records)
                    log(f"{arm.name} @{load.stream_rate_per_s:g}/s #{rep}: valid={run['valid']} "
                        f"load={run['cpu']['load_avg_1m']}")  # fmt: skip
    log("stopped the pool")
    report["load_points"] = [
        {"stream_rate_per_s": t.stream_rate_per_s,
         "arms": aggregate(*_of_rate(runs, records, t.stream_rate_per_s), arms, t, LIMITS)}
        for t in traffics
    ]  # fmt: skip
    report["runs"] = runs
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
