"""The worker's device memory split, for /metrics (``kvflow_worker_device_memory_bytes``).

Parts: ``weights`` and ``kv_cache`` from the engine's own accounting (memory/report.py:
what it loaded and what it allocated, the same on every device); ``cuda_graphs``, the
CUDA-graph pools' segments in torch's allocator (graphs are captured lazily, one per decode
bucket on its first step, so this grows in the first minutes); ``other``, the rest of what
torch's allocator holds on the device (activations, workspaces, its free cache).

Not in the split: what the process holds outside torch's allocator (the CUDA context,
cuBLAS and NCCL buffers) and what other processes hold: DCGM's ``DCGM_FI_DEV_FB_USED`` is
the whole device (docs/observability.md). On the CPU there are no graphs (``cuda_graphs``
is 0) and no allocator to split, so ``other`` is not reported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kvflow.engine_worker.memory.report import MemoryReport

PARTS = ("weights", "kv_cache", "cuda_graphs", "other")
_DEFAULT_POOL = (0, 0)  # torch's own pool; CUDA graphs (and user mempools) have others
# A scrape reads all four parts; one allocator snapshot serves them.
_CACHE_S = 1.0


def graph_pool_bytes(segments: Iterable[Mapping[str, Any]], device_index: int) -> int:
    """Bytes of the device's segments that belong to a private pool (a CUDA graph's)."""
    return sum(
        int(s["total_size"])
        for s in segments
        if s.get("device", device_index) == device_index
        and tuple(s["segment_pool_id"]) != _DEFAULT_POOL
    )


def split(
    weight_bytes: int, kv_cache_bytes: int, graph_bytes: int, reserved_bytes: int | None
) -> dict[str, int]:
    """The parts; ``reserved_bytes``: torch's allocator's total on the device, None on the CPU
    (no ``other``). ``other`` is never negative (weights loaded before the allocator saw
    them, e.g. mapped from a file, are counted in ``weights`` only)."""
    parts = {"weights": weight_bytes, "kv_cache": kv_cache_bytes, "cuda_graphs": graph_bytes}
    if reserved_bytes is not None:
        parts["other"] = max(reserved_bytes - weight_bytes - kv_cache_bytes - graph_bytes, 0)
    return parts


class DeviceMemoryProbe:
    """Reads the split of one worker's device, at most once a second."""

    def __init__(self, report: MemoryReport, device: torch.device) -> None:
        self._weights = sum(report.weight_bytes.values())
        self._kv_cache = report.kv_cache_bytes
        self._device = device
        self._lock = threading.Lock()
        self._read_at_s = -_CACHE_S
        self._parts: dict[str, int] = {}

    @property
    def parts(self) -> tuple[str, ...]:
        return PARTS if self._device.type == "cuda" else PARTS[:3]

    def read(self) -> dict[str, int]:
        with self._lock:
            now_s = time.monotonic()
            if now_s - self._read_at_s >= _CACHE_S:
                self._parts = self._measure()
                self._read_at_s = now_s
            return self._parts

    def reader(self, part: str) -> Callable[[], float]:
        return lambda: float(self.read().get(part, 0))

    def _measure(self) -> dict[str, int]:
        if self._device.type != "cuda":
            return split(self._weights, self._kv_cache, 0, None)
        index = self._device.index if self._device.index is not None else 0
        segments = torch.cuda.memory_snapshot(include_traces=False)  # type: ignore[no-untyped-call]
        reserved = torch.cuda.memory_reserved(index)
        return split(self._weights, self._kv_cache, graph_pool_bytes(segments, index), reserved)
