"""Where the time of a KV transfer goes on this CPU (bench/kv_transfer.py, full run).

Times, in one peer process, the pieces a transport does with the blocks of the largest
transfer: a gather into an already touched buffer (``TransferBlocks.read``, what gloo and
a staged TCP transfer do per message), a scatter from one (``TransferBlocks.write``), the
iovec array that in-place TCP hands to the kernel, and a plain copy of the same bytes
between two touched buffers: the memory speed the gather and scatter are measured against.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from kvflow.engine_worker.runner import TorchModelRunner


def profile_block_io(
    runner: TorchModelRunner, block_ids: Sequence[int], touched: torch.Tensor, reps: int
) -> dict[str, float]:
    """Medians (s) over ``reps``; ``touched``: a contiguous buffer at least the transfer's
    size whose pages are already mapped."""
    blocks = runner.transfer_blocks(block_ids)
    flat = touched.reshape(-1).view(torch.uint8)[: blocks.num_bytes]
    other = torch.empty_like(flat)
    other.copy_(flat)  # touched before timing
    samples: dict[str, list[float]] = {}

    def lap(name: str, started: float) -> float:
        now = time.monotonic()
        samples.setdefault(name, []).append(now - started)
        return now

    for _ in range(reps):
        t = time.monotonic()
        blocks.read(0, blocks.num_runs, flat)
        t = lap("gather_into_touched", t)
        blocks.write(0, blocks.num_runs, flat)
        t = lap("scatter_from_touched", t)
        blocks.iovecs()
        t = lap("iovecs", t)
        other.copy_(flat)
        lap("contiguous_copy", t)
    return {k: statistics.median(v) for k, v in samples.items()}
