"""`kvflow sim calibrate`: a fitted profile's predictions against the real engine.

Builds the real engine with the profile's own limits (step budget, sequences, KV blocks),
runs held-out shared-prefix traffic on it in wall time and on the profile in virtual time,
and prints both sides' TTFT and TPOT P50 with the simulator's error. Exit 0 when both
P50 errors are within ``--tolerance``, 1 when not, 2 for bad options.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TextIO

from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.proto.cli_args import number_of, positive_int, seconds
from kvflow.sim.calibrate import calibrate


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow sim calibrate", description=__doc__)
    p.add_argument("--profile", required=True, help="a file from `kvflow profile`")
    p.add_argument("--model", help="the model it was fitted on (default: SmolLM2-135M)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads, as when fitted")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="the real side's clock, as the profile was fitted (calibrate.py)",
    )
    p.add_argument(
        "--rate",
        type=number_of("requests/s", allow_zero=False),
        default=1.0,
        help="Poisson arrivals, req/s",
    )
    p.add_argument("--duration-s", type=seconds(allow_zero=False), default=60.0)
    p.add_argument("--warmup-s", type=seconds(allow_zero=True), default=10.0)
    p.add_argument("--groups", type=positive_int, default=4)
    p.add_argument("--prefix-words", default="384,192")
    p.add_argument("--question-words", type=positive_int, default=48)
    p.add_argument("--output-tokens", type=positive_int, default=24)
    p.add_argument(
        "--tolerance", type=number_of("x the real figure", allow_zero=False), default=0.15
    )
    p.add_argument("--seed", type=int, default=1, help="traffic seed (the sweep used 0)")
    return p


# Past this, the check's own steps are off the fit by more than the machine's run-to-run
# spread (bench/calibration_spread.py: at most 12 % over 10 fresh fits).
STEP_DRIFT_WARN = 0.15


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def main(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    args = parser().parse_args(list(argv))
    try:
        profile = resolve_profile(args.profile)
        prefix_words = tuple(int(w) for w in args.prefix_words.split(","))
        workload = SharedPrefixWorkload(num_groups=args.groups, users_per_group=4,
                                        prefix_words=prefix_words,
                                        question_words=args.question_words,
                                        output_tokens=args.output_tokens)  # fmt: skip
    except (ProfileError, ValueError) as exc:
        print(f"kvflow sim calibrate: {exc}", file=err)
        return 2
    import torch

    from kvflow.engine_worker.app import build_worker
    from kvflow.engine_worker.settings import WorkerSettings

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    settings = WorkerSettings(model=args.model, block_size=profile.block_size,
                              max_num_batched_tokens=profile.max_num_batched_tokens,
                              max_num_seqs=profile.max_num_seqs,
                              num_kv_blocks=profile.num_kv_blocks)  # fmt: skip
    engine = build_worker(settings).engine
    result = calibrate(
        engine,
        profile,
        workload,
        rate_per_s=args.rate,
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        seed=args.seed,
        clock=args.clock,
    )
    real, sim = result.real, result.simulated
    for name, side in (("real engine", real), ("simulated", sim)):
        lat = side.latency
        ms = [(v or 0.0) * 1e3 for v in (lat.ttft_s.p50, lat.ttft_s.p90, lat.tpot_s.p50,
                                          lat.tpot_s.p90)]  # fmt: skip
        print(f"{name:12s} n={side.throughput.num_measured:4d} TTFT p50 {ms[0]:7.1f} ms "
              f"p90 {ms[1]:7.1f} ms  TPOT p50 {ms[2]:6.1f} ms p90 {ms[3]:6.1f} ms  "
              f"hit {side.cache.hit_rate or 0:.2f}", file=out)  # fmt: skip
    print(
        f"simulator error at P50: TTFT {_pct(result.ttft_p50_error)}, "
        f"TPOT {_pct(result.tpot_p50_error)} (tolerance {args.tolerance:.0%})",
        file=out,
    )
    print(f"simulator error in the mean: TTFT {_pct(result.ttft_mean_error)}, "
          f"TPOT {_pct(result.tpot_mean_error)}", file=out)  # fmt: skip
    drift = result.step_drift
    hint = ("; the machine changed since the fit: fit the profile again"
            if drift is not None and abs(drift) > STEP_DRIFT_WARN else "")  # fmt: skip
    print(
        f"step drift: the real engine's steps ran {_pct(drift)} against the profile's "
        f"step model (median over {len(result.real_steps)} steps){hint}",
        file=out,
    )
    errors = [result.ttft_p50_error, result.tpot_p50_error]
    return 0 if all(e is not None and abs(e) <= args.tolerance for e in errors) else 1
