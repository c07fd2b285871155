"""The machine as the other stages see it: versions, the device, and two measured ceilings.

The copy bandwidth (a device-to-device copy, bytes read plus written over the time) is the
HBM ceiling this GPU actually reaches; the roofline of the report is computed against both
it and the datasheet's 4.8 TB/s. The bf16 matrix rate is the compute ceiling.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from typing import Any

import torch

from gpu.plan import Plan
from gpu.record import Deadline, Recorder


def _timed(fn: Any, device: str, reps: int) -> float:
    fn()  # warm-up: allocator, cuBLAS handle, clocks
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def copy_bandwidth(device: str, num_bytes: int, reps: int = 10) -> float:
    """Bytes per second of one copy (read plus written) of ``num_bytes``."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), device, reps)
    return 2 * num_bytes / seconds


def matmul_flops(device: str, n: int, dtype: torch.dtype, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device, reps)
    return 2 * n**3 / seconds


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    import numpy

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    try:  # the version without the import (several seconds)
        info["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        info["transformers"] = "missing"
    rec.set("versions", info)
    device = plan.device
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        rec.set(
            "device",
            {
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count,
                "device_count": torch.cuda.device_count(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            },
        )
    else:
        rec.set("device", {"name": "cpu", "threads": torch.get_num_threads()})
    big = plan.size == "full"
    with rec.part("copy_bandwidth"):
        # 4 GiB on the GPU, many times its 60 MB L2; 64 MiB on a CPU.
        num_bytes = (4 << 30) if device.startswith("cuda") else (64 << 20)
        rec.set("copy_bytes_per_s", copy_bandwidth(device, num_bytes))
    with rec.part("matmul"):
        n = 8192 if big else (4096 if device.startswith("cuda") else 256)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        rec.set(
            "matmul_flops", {"n": n, "dtype": str(dtype), "flops": matmul_flops(device, n, dtype)}
        )
