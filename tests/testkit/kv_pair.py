"""What the KV transfer tests share: a small random paged cache, and a completion callback
to wait on (the agent reports each transfer's outcome from its own thread)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from kvflow.engine_worker.model.paged_cache import kv_cache_shape


def cache(seed: int) -> list[torch.Tensor]:
    """Keys and values of 12 blocks of 4 tokens, 2 KV heads of 8 dims, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
    return [torch.randn(shape, generator=gen) for _ in range(2)]


class Outcome:
    """A callback that keeps what it was called with; ``wait`` returns it (20 s at most)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def __call__(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def wait(self) -> Any:
        assert self.event.wait(20), "no completion"
        return self.value
