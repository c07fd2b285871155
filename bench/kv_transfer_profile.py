"""Where the gather and scatter time of a KV transfer goes (bench/kv_transfer.py, full run).

Times, in one peer process, TorchModelRunner's read_blocks and its two parts, the same
gather into an already touched buffer, the first touch of a fresh buffer of the transfer's
size (what a receive into a new empty_blocks buffer pays in page faults), and write_blocks
next to a scatter by one copy per block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from kvflow.engine_worker.runner import TorchModelRunner


def scatter_by_block(kv: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """write_blocks' job for one layer, one strided copy per block ([2, heads, block, dim],
    16 runs of 4 KiB in bf16) instead of index_copy_ along the pool axis, which this CPU
    runs 2.5-4x slower (0.19-0.32 s vs 0.08 s for 256 MiB of bf16 on 2 busy cores)."""
    for j, block in enumerate(block_ids):
        kv[:, :, block].copy_(data[:, :, j])


def profile_block_io(
    runner: TorchModelRunner, block_ids: Sequence[int], touched: torch.Tensor, reps: int
) -> dict[str, float]:
    """Medians (s) over ``reps``; ``touched`` is a contiguous buffer of the blocks' shape
    whose pages are already mapped (a reused staging buffer)."""
    idx = torch.tensor(list(block_ids), dtype=torch.int64)
    caches = runner.kv_caches
    samples: dict[str, list[float]] = {}

    def lap(name: str, started: float) -> float:
        now = time.monotonic()
        samples.setdefault(name, []).append(now - started)
        return now

    with torch.inference_mode():
        for _ in range(reps):
            t = time.monotonic()
            out = runner.read_blocks(block_ids)
            del out
            t = lap("read_blocks", t)
            # read_blocks' own steps: a fresh per-layer copy each, then a stack of them all.
            parts = [kv.index_select(2, idx) for kv in caches]
            t = lap("read_blocks.index_select", t)
            out = torch.stack(parts)
            del out, parts
            t = lap("read_blocks.stack", t)
            for layer, kv in enumerate(caches):
                torch.index_select(kv, 2, idx, out=touched[layer])
            t = lap("index_select_into_touched_buffer", t)
            runner.empty_blocks(len(block_ids)).fill_(0)
            t = lap("empty_blocks_first_touch", t)
            runner.write_blocks(block_ids, touched)
            t = lap("write_blocks", t)
            for layer, kv in enumerate(caches):
                scatter_by_block(kv, block_ids, touched[layer])
            lap("write_blocks.copy_per_block", t)
    return {k: statistics.median(v) for k, v in samples.items()}
