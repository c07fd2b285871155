"""`kvflow profile` of the 8B shape: the simulator's step-time model fitted on this device.

The same sweep and fit as ``kvflow profile`` (engine_worker/sim/profile_cli.py: its
``default_sweep``, ``run_sweep`` and ``fit_timing``), over the random-weight engine of the
plan's shape instead of a model file, timed by the wall clock (on a GPU a step's time is
the device's, which the sampled token's copy to the host waits for). The profile (schema
``kvflow-sim-profile/1``) goes into the stage's result; bench/gpu_check.py also writes it
as a file of its own beside the JSON, for ``kvflow sim --profile`` and ``kvflow plan
--profile``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpu.models import engine_config, kvflow_random, make_engine
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from gpu.shapes import SHAPES
from kvflow.engine_worker.sim.fit import fit_timing
from kvflow.engine_worker.sim.hardware import H200_SXM
from kvflow.engine_worker.sim.profile_file import profile_to_dict
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.engine_worker.sim.sweep import SweepPoint, default_sweep, run_sweep

# kvflow profile's KV link on a CPU machine (profile_cli.CPU_KV_LINK_BYTES_PER_S, not
# imported: its module pulls in the worker's settings and with them grpc, whose wheel on
# the device image may refuse the committed stubs).
CPU_KV_LINK_BYTES_PER_S = 2.4e9


def kv_bytes_per_block(runner: Any) -> int:
    """The runner's KV bytes per block (all layers, K and V), from its cache tensors, whose
    first dimension is the block (a graphed runner's spare block included)."""
    total = sum(int(t.numel()) * int(t.element_size()) for t in runner.kv_caches)
    return total // int(runner.kv_caches[0].shape[0])


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    p = plan.profile
    device = plan.device
    is_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    config = engine_config(SHAPES[p.shape], p.shape)
    log(f"profile: building {p.shape}")
    model = kvflow_random(config, dtype, device, plan.seed)
    built = make_engine(
        model,
        config,
        dtype=dtype,
        device=device,
        num_blocks=p.num_kv_blocks,
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_model_len=config.max_position_embeddings,
    )
    engine = built.engine
    points = default_sweep(min(p.max_prompt_tokens, engine.max_len - 64), quick=p.quick)
    started = time.monotonic()
    # One sweep per batch size (each pays a warm-up of its first, shortest point), so a
    # budget that runs out keeps the batch sizes already swept and fits on those.
    groups: dict[int, list[SweepPoint]] = {}
    for point in points:
        groups.setdefault(point.num_requests, []).append(point)
    samples = []
    swept: list[int] = []
    longest_s = 0.0
    for batch, group in groups.items():
        if swept and deadline.left_s() < 5 + 2 * longest_s:
            log(f"profile: stage budget would not hold batch {batch}: fitting on {swept}")
            break
        group_start = time.monotonic()
        samples += run_sweep(engine, group, seed=plan.seed, clock=time.perf_counter)
        swept.append(batch)
        longest_s = max(longest_s, time.monotonic() - group_start)
        log(f"profile: batch {batch} swept ({len(samples)} steps so far)")
    rec.set("batches_swept", swept)
    fit = fit_timing(samples)
    device_name = torch.cuda.get_device_name(device) if is_cuda else "cpu"
    slug = device_name.lower().replace("nvidia ", "").replace(" ", "-")
    profile = SimProfile(
        name=f"measured-{p.shape}-{slug}",
        timing=fit.timing,
        block_size=engine.config.scheduler.block_size,
        kv_bytes_per_block=kv_bytes_per_block(built.runner),
        num_kv_blocks=built.num_blocks,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=p.max_num_seqs,
        kv_link_bytes_per_s=H200_SXM.kv_link_bytes_per_s if is_cuda else CPU_KV_LINK_BYTES_PER_S,
        source=f"measured by bench/gpu_check.sh (kvflow profile's sweep and fit): {p.shape} "
        f"random weights on {device_name} ({str(dtype).removeprefix('torch.')}, wall clock, "
        f"eager), {fit.num_samples} steps of {sum(len(groups[b]) for b in swept)} sweep points "
        f"(batches {swept}), R^2 "
        f"{fit.r_squared:.3f}, median step error {fit.median_abs_error_fraction:.1%}",
    )
    rec.set("sweep_s", time.monotonic() - started)
    rec.set(
        "fit",
        {
            "num_samples": fit.num_samples,
            "r_squared": fit.r_squared,
            "median_abs_error_fraction": fit.median_abs_error_fraction,
        },
    )
    rec.set("profile", profile_to_dict(profile))
    log(f"profile: {profile.source}")
