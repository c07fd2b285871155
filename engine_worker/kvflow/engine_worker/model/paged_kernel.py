"""Whether decodes attend through a paged kernel that reads the cache in place, and the
Triton kernel's module, imported only where it can run.

On CUDA the Triton kernel (triton_paged.py); on the CPU the C kernel (cpu_paged.py, in
float32 over a float32, bf16, int8 or fp8 cache, whether attention computes in float32 or,
for a bf16 model on a CPU with native bf16, in bf16). Elsewhere decodes gather their
blocks (or read the decode workspace) and run SDPA."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kvflow.engine_worker.model import cpu_paged


def uses_paged_kernel(
    device: torch.device,
    block_size: int,
    kv_cache_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> bool:
    """Whether decodes on ``device`` attend through a paged kernel rather than a gather and
    SDPA: on CUDA devices, when Triton imports and the block size is a power of two (the
    kernel's token axis); on the CPU when the C kernel builds, reads the cache's dtype and
    takes queries in attention's compute dtype (both given: the runner knows them;
    ``cpu_paged.supports``)."""
    if device.type == "cpu":
        if kv_cache_dtype is None or compute_dtype is None:
            return False
        return cpu_paged.supports(device, kv_cache_dtype, compute_dtype)
    if device.type != "cuda" or block_size & (block_size - 1):
        return False
    return triton_paged_module() is not None


@functools.cache
def triton_paged_module() -> ModuleType | None:
    """The kernel's module, imported on first use on a GPU (None: Triton is missing)."""
    try:
        from kvflow.engine_worker.model import triton_paged
    except ImportError:
        return None
    return triton_paged
