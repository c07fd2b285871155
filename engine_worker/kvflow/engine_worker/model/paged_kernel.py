"""Whether decodes attend through the paged Triton kernel (triton_paged.py), and the
kernel's module, imported only where it can run."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def uses_paged_kernel(device: torch.device, block_size: int) -> bool:
    """Whether decodes on ``device`` attend through the paged Triton kernel (triton_paged.py)
    rather than a gather and SDPA: on CUDA devices, when Triton imports and the block size
    is a power of two (the kernel's token axis). Never on the CPU: Triton compiles for GPUs."""
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
