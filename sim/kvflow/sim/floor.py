"""The least TTFT any router could give a request: its prompt prefilled alone, on an idle
worker that holds every block an earlier request's prompt had. Pure.

Whatever the placement, a request waits at least for the prompt tokens no earlier request
shared with it (a worker's cache only holds blocks of earlier prompts; the engine always
computes the last prompt token), in at least ``ceil(tokens / max_num_batched_tokens)``
steps, each at least the step's base time and one prefill sequence's. Each request's TTFT
is then at least its floor, so a rung's TTFT P90 is at least the floors' P90 under any
router: the part of round-robin's P90 a router can take away is what lies above it (on
the Mooncake trace the floors' P90 is 0.80 s of round-robin's 1.00 s at 1x,
docs/benchmarks.md, "Routing comparison").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvflow.loadgen.metrics import percentile
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.step_model import StepTiming


def prefill_floor_s(timing: StepTiming, num_tokens: int, max_num_batched_tokens: int) -> float:
    """Seconds to prefill ``num_tokens`` (at least 1) alone: the per-KV-token term left
    out, so it stays a floor."""
    num_tokens = max(1, num_tokens)
    num_steps = math.ceil(num_tokens / max_num_batched_tokens)
    per_step_s = timing.base_step_s + timing.per_prefill_seq_s
    return num_steps * per_step_s + num_tokens * timing.per_prefill_token_s


class TtftFloor:
    """Each request's floor, fed in arrival order (every request, refused or not: the
    floor is the same for every arm)."""

    def __init__(self, timing: StepTiming, max_num_batched_tokens: int, block_size: int) -> None:
        assert max_num_batched_tokens >= 1 and block_size >= 1
        self._timing = timing
        self._max_batched = max_num_batched_tokens
        self._block_size = block_size
        self._seen: set[BlockHash] = set()
        self.floor_s: dict[str, float] = {}

    def add(self, request_id: str, block_hashes: Iterable[BlockHash], num_tokens: int) -> float:
        hashes = list(block_hashes)
        max_blocks = (num_tokens - 1) // self._block_size  # never the last prompt token
        num_shared = 0
        for block_hash in hashes[:max_blocks]:
            if block_hash not in self._seen:
                break
            num_shared += 1
        self._seen.update(hashes)
        floor = prefill_floor_s(self._timing, num_tokens - num_shared * self._block_size,
                                self._max_batched)  # fmt: skip
        self.floor_s[request_id] = floor
        return floor

    def p90_s(self, request_ids: Sequence[str]) -> float | None:
        """The floors' P90 over ``request_ids`` (the measured ones); None for none."""
        floors = sorted(self.floor_s[r] for r in request_ids)
        return percentile(floors, 0.9) if floors else None
