"""`kvflow worker`'s KV cache flags: its blocks, its memory and its dtype."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.settings.record import DEFAULT_GPU_MEMORY_UTILIZATION, WorkerSettings
from kvflow.proto.cli_args import number_of, positive_int

# auto: the model's dtype; int8 and fp8 (e4m3): one byte per value and a float16 scale per
# token and head (model/kv_quant.py), 1.94x the tokens of a bf16 cache per byte.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def add_cache_flags(p: argparse.ArgumentParser, d: WorkerSettings) -> None:
    p.add_argument(
        "--block-size", type=positive_int, default=d.block_size, help="tokens per KV block"
    )
    p.add_argument(
        "--kv-cache-gib",
        type=number_of("GiB", allow_zero=False),
        help="memory for the KV cache (default: 1 GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=positive_int,
        help="KV blocks to allocate (overrides --kv-cache-gib)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="on CUDA, the fraction of the device's memory this worker uses: weights, a "
        "measured peak forward, CUDA graphs, and the KV cache in what is left "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION}); --kv-cache-gib or --num-kv-blocks "
        "size the cache instead",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="auto: the model's dtype; int8 or fp8 (e4m3): one byte per value and a float16 "
        "scale per token and KV head, 1.94x the tokens of a bf16 cache (3.9x float32's); "
        "every worker of a disaggregated pool must use the same",
    )
    p.add_argument(
        "--decode-workspace-gib",
        type=number_of("GiB", allow_zero=True),
        help="memory for dense copies of the decoding sequences' K/V, so decode attention "
        "copies no blocks each step (default: as much as --kv-cache-gib on CPU, 0 on CUDA; "
        "0 turns it off; unused where decodes read the paged cache in place, see "
        "--no-paged-attention)",
    )
    p.add_argument(
        "--no-paged-attention",
        action="store_true",
        help="decodes gather their blocks (or read the decode workspace) instead of reading "
        "the paged cache in place through kvflow's kernel (the CPU's C kernel, or "
        "Triton's on CUDA)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")


def memory_flags_problem(a: argparse.Namespace) -> str:
    """What is wrong with the memory and KV-dtype flags together, or ""."""
    utilization = a.gpu_memory_utilization
    if utilization is not None and not 0.0 < utilization <= 1.0:
        return f"--gpu-memory-utilization {utilization:g} must lie in (0, 1]"
    if utilization is not None and (a.simulate or not a.device.startswith("cuda")):
        return (
            "--gpu-memory-utilization sizes a CUDA device's memory; on the CPU (or with "
            "--simulate) size the KV cache with --kv-cache-gib or --num-kv-blocks"
        )
    if a.kv_cache_dtype != "auto" and a.simulate:
        return (
            "--simulate models the KV bytes of its profile (or SmolLM2's float32): drop "
            "--kv-cache-dtype, or give the block count with --num-kv-blocks"
        )
    if a.kv_cache_dtype == "fp8":
        # Only here does the command line import torch: a worker that asks for fp8 runs it.
        import torch

        from kvflow.engine_worker.model.kv_quant import (
            KvCacheDtypeError,
            check_device_supports,
            kv_cache_dtype,
        )

        try:
            check_device_supports(kv_cache_dtype("fp8", torch.float32), a.device)
        except KvCacheDtypeError as exc:
            return str(exc)
    return ""
