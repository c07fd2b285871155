"""The machine's side of bench/engine_roofline.py: the bandwidth it streams from beyond its
last-level cache, the batch-1 decode ceiling whatever the weights' format."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
# The read bandwidth's buffer: this many times the last-level cache, so no pass is served
# from cache (at least 256 MiB, at most 4 GiB).
STREAM_LLC_MULTIPLE = 4


def last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for CPU 0 (a VM reports what its host tells it);
    32 MiB when it reports none."""
    sizes = []
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 * MIB)


def stream_bandwidth(num_bytes: int, passes: int) -> dict[str, Any]:
    """Bytes per second of three streaming kernels over ``num_bytes`` of float32, on all of
    torch's threads, each the median and the best of ``passes`` after a warm-up: a sum (read
    only), a matrix-vector product over the buffer as a 4096-wide matrix (read only, the
    BLAS kernel batch-1 decode runs, but over no weights of the model) and a copy of half
    into the other half (read plus written). ``bandwidth_gb_s`` is the fastest median: what
    this machine demonstrably streams from beyond its caches (on a 2-core VM torch's sum
    reached 12 GB/s where the product reached 15)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    half = buf[: buf.numel() // 2]
    dst = torch.empty_like(half)

    def timed(fn: Any) -> list[float]:
        fn()
        out = []
        for _ in range(passes):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    read = timed(buf.sum)
    matrix = buf[: buf.numel() // 4096 * 4096].view(-1, 4096)
    vector = torch.ones(4096)
    gemv = timed(lambda: torch.mv(matrix, vector))
    copy = timed(lambda: dst.copy_(half))
    copied = 2 * half.numel() * 4
    r = {
        "bytes": num_bytes,
        "threads": torch.get_num_threads(),
        "read_gb_s": num_bytes / statistics.median(read) / 1e9,
        "read_best_gb_s": num_bytes / min(read) / 1e9,
        "gemv_gb_s": matrix.numel() * 4 / statistics.median(gemv) / 1e9,
        "gemv_best_gb_s": matrix.numel() * 4 / min(gemv) / 1e9,
        "copy_gb_s": copied / statistics.median(copy) / 1e9,
        "copy_best_gb_s": copied / min(copy) / 1e9,
    }
    r["bandwidth_gb_s"] = max(r["read_gb_s"], r["gemv_gb_s"], r["copy_gb_s"])
    r["bandwidth_best_gb_s"] = max(r["read_best_gb_s"], r["gemv_best_gb_s"], r["copy_best_gb_s"])
    return r
