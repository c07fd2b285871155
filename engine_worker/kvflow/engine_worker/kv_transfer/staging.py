"""Staging buffers for transports that cannot move the cache in place (gloo and NCCL take
one contiguous tensor per message; a CUDA cache reaches a socket through host memory).

A fresh buffer costs its page faults on first touch: 0.5-2.8 s per GiB on this machine,
more than the wire time, because a large allocation is always a new mmap. So a transfer
borrows a few message-sized buffers and gives them back, and the next transfer finds them
touched. Bounds: the pool keeps at most ``max_idle_bytes`` of idle buffers (by default 4
messages of 16 MiB, 64 MiB per worker) and drops, at its next use, those idle longer than
``max_idle_s``, so a worker that stops transferring keeps 64 MiB at most; in use, each
transfer holds PIPELINE_DEPTH messages (32 MiB): a prefill worker sends at most 16 at
once (agent.MAX_CONCURRENT_SENDS) and a decode worker moves at most 16 payloads in
(torch_dist.MAX_MOVING_RECEIVES), 512 MiB each way.
A buffer that a failed transfer may still be moving is never given back (the transport
drops it), so it cannot leak into another transfer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

# Messages of 16 MiB, two in flight: the sender gathers one while gloo sends the other,
# the receiver scatters one while the other arrives. Over gloo on this 2-core machine
# (512 MiB, medians of 6, load 2-3): 16 MiB x 2 moved 1.26-1.41 GB/s, 16 MiB x 3 1.15-1.39,
# 8 MiB x 3 1.09-1.22, 4 MiB x 3 1.03-1.23: every message is a hand-off between our thread
# and gloo's, and fewer hand-offs win over keeping a message in the L3 cache.
MESSAGE_BYTES = 16 << 20
PIPELINE_DEPTH = 2
MAX_IDLE_BYTES = 4 * MESSAGE_BYTES
MAX_IDLE_S = 30.0


class StagingPool:
    def __init__(
        self,
        *,
        max_idle_bytes: int = MAX_IDLE_BYTES,
        max_idle_s: float = MAX_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.max_idle_s = max_idle_s
        self._clock = clock
        self._idle: list[tuple[float, torch.Tensor]] = []  # (given back at, buffer), oldest first
        self._lock = threading.Lock()

    @property
    def num_idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for _, b in self._idle)

    def take(self, num_bytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of exactly ``num_bytes`` on ``device``: an idle one if the pool has
        it (already touched), else a new one."""
        with self._lock:
            self._drop_stale()
            for i, (_, buffer) in enumerate(self._idle):
                if buffer.numel() == num_bytes and buffer.device == device:
                    del self._idle[i]
                    return buffer
        return torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Return a buffer nothing uses any more; the oldest idle ones go past the bound."""
        with self._lock:
            self._idle.append((self._clock(), buffer))
            self._drop_stale()
            total = sum(b.numel() for _, b in self._idle)
            while self._idle and total > self.max_idle_bytes:
                total -= self._idle.pop(0)[1].numel()

    def _drop_stale(self) -> None:
        cutoff = self._clock() - self.max_idle_s
        while self._idle and self._idle[0][0] < cutoff:
            self._idle.pop(0)
