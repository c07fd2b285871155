"""`kvflow profile`: fit a simulated worker's step timing to the real engine on this machine.

Loads the model as `kvflow worker` would, runs the engine in process through a sweep of
batch shapes (``sweep.py``), fits the linear step model by least squares (``fit.py``) and
writes a profile file that `kvflow worker --simulate --sim-profile FILE` and
`kvflow sim` take. docs/simulator.md shows a run and the calibration check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvflow.engine_worker.settings import DTYPES
from kvflow.engine_worker.sim.fit import fit_timing
from kvflow.engine_worker.sim.profile_file import write_profile
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.engine_worker.sim.sweep import SweepPoint, default_sweep, run_sweep

# KV between two worker processes on one CPU machine over gloo: 2.3-2.5 GB/s measured
# (on the project's 2-core test machines; docs/benchmarks.md, "KV transfer (PD)").
CPU_KV_LINK_BYTES_PER_S = 2.4e9


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvflow profile",
        description="Time the real engine over a sweep of batch shapes and write a "
        "simulated-worker profile (least-squares fit of the step-time model).",
    )
    p.add_argument("--model", help="Hugging Face folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    p.add_argument("--name", help="the profile's name (default: fitted-<model>-<device>)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's own)")
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="time steps by this thread's CPU time (the default: what a step costs on a "
        "core of its own, whatever else runs; needs --threads 1) or by the wall clock",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a third of the sweep, 8 output tokens: a smoke test; on the tiny model its fits "
        "mostly predicted steps 25-45 %% faster than the real engine ran them (the full "
        "sweep: within 35 %% either way)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--samples-out",
        help="also write every timed step (its shape and seconds) as JSON, to study the "
        "model's error (bench/calibration_spread.py)",
    )
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            print(f"kvflow profile: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    import torch

    from kvflow.engine_worker.app import build_worker
    from kvflow.engine_worker.settings import WorkerSettings

    if args.clock == "cpu" and args.threads != 1:
        print("kvflow profile: --clock cpu times one thread: pass --threads 1", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    settings = WorkerSettings(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        seed=args.seed,
    )
    try:
        built = build_worker(settings)
    except ValueError as exc:  # ModelLoadError says which file or field
        print(f"kvflow profile: {exc}", file=sys.stderr)
        return 1
    engine = built.engine
    points = default_sweep(min(args.max_prompt_tokens, engine.max_len - 64), quick=args.quick)

    def progress(index: int, point: SweepPoint) -> None:
        print(f"kvflow profile: {index + 1}/{len(points)} {point}", file=sys.stderr, flush=True)

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    samples = run_sweep(engine, points, seed=args.seed, clock=clock, on_point=progress)
    fit = fit_timing(samples)
    config = engine.config
    model_name = built.info.model
    profile = SimProfile(
        name=args.name or f"fitted-{model_name}-{args.device}",
        timing=fit.timing,
        block_size=config.scheduler.block_size,
        kv_bytes_per_block=kv_bytes_per_block(built.runner, config.num_kv_blocks),
        num_kv_blocks=config.num_kv_blocks,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        kv_link_bytes_per_s=CPU_KV_LINK_BYTES_PER_S,
        source=f"fitted: {model_name} on {args.device} ({args.dtype}, {torch.get_num_threads()} "
        f"threads, {args.clock} clock), {fit.num_samples} steps of {len(points)} sweep points, "
        f"R^2 {fit.r_squared:.3f}, median step error {fit.median_abs_error_fraction:.1%}",
    )
    write_profile(profile, Path(args.out))
    if args.samples_out:
        rows = [{**dataclasses.asdict(s.shape), "seconds": s.seconds} for s in samples]
        Path(args.samples_out).write_text(json.dumps(rows))
    print(f"kvflow profile: {profile.source}", file=sys.stderr)
    print(f"kvflow profile: {profile.timing}", file=sys.stderr)
    print(f"kvflow profile: wrote {args.out}", file=sys.stderr)
    return 0


def kv_bytes_per_block(runner: object, num_blocks: int) -> int:
    """The real runner's KV bytes per block (all layers, K and V), from its cache tensors."""
    caches = getattr(runner, "kv_caches", None)
    if not caches:
        return int(getattr(runner, "kv_bytes_per_block", 1))
    total = sum(int(t.numel()) * int(t.element_size()) for t in caches)
    return total // num_blocks
