"""The least TTFT any router could give a request: its prompt prefilled alone, on an idle
worker that holds every block an earlier request's prompt had, as soon as that block could
exist. Pure.

Whatever the placement, a request waits at least for the prompt tokens no earlier request
shared with it (a worker's cache only holds blocks of earlier prompts; the engine always
computes the last prompt token), in at least ``ceil(tokens / max_num_batched_tokens)``
steps, each at least the step's base time and one prefill sequence's. A shared block is
of use only once it exists: no earlier than its first request's arrival plus the prefill
of that request's tokens up to it (past what that request could reuse), so a request
that arrives while its prefix is still being prefilled elsewhere either waits for it or
computes it again, and its floor is the lesser of the two. Each request's TTFT is then at
least its floor, so a rung's TTFT P90 is at least the floors' P90 under any router: the
part of round-robin's P90 a router can take away is what lies above it
(docs/benchmarks.md, "Routing comparison").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvflow.loadgen.metrics import percentile
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
    floor is the same for every arm).

    A block is known by its tokens and its prefix's, as the engine's block hashes know it,
    but through Python's tuple hash rather than the gateway's SHA-256 chain: the floor
    reads every block of every prompt under every arm, and with the SHA-256 chain the
    Mooncake trace's round-robin run took 1.28x as long as without a floor (46 s against
    36 s; 1.10x this way). A collision could only lower a floor, which stays a floor."""

    def __init__(self, timing: StepTiming, max_num_batched_tokens: int, block_size: int) -> None:
        assert max_num_batched_tokens >= 1 and block_size >= 1
        self._timing = timing
        self._max_batched = max_num_batched_tokens
        self._block_size = block_size
        # block -> the earliest time it could exist in any cache
        self._ready_s: dict[int, float] = {}
        self.floor_s: dict[str, float] = {}

    def _prefill_s(self, num_tokens: int) -> float:
        return prefill_floor_s(self._timing, num_tokens, self._max_batched)

    def add(self, request_id: str, token_ids: Sequence[int], arrival_s: float = 0.0) -> float:
        size = self._block_size
        num_tokens = len(token_ids)
        keys, key = [], 0
        for i in range(num_tokens // size):
            key = hash((key, tuple(token_ids[i * size : (i + 1) * size])))
            keys.append(key)
        # Reusing the first k blocks an earlier prompt had: wait until all k exist, then
        # compute the rest; never the block with the last prompt token.
        floor, latest_s, num_shared = self._prefill_s(num_tokens), -math.inf, 0
        for key in keys[: (num_tokens - 1) // size]:
            ready_s = self._ready_s.get(key)
            if ready_s is None:
                break
            num_shared += 1
            latest_s = max(latest_s, ready_s)
            wait_s = max(0.0, latest_s - arrival_s)
            floor = min(floor, wait_s + self._prefill_s(num_tokens - num_shared * size))
        # This prompt's other blocks exist no earlier than their prefill from the most it
        # could reuse, at the per-token rate alone.
        per_token_s = self._timing.per_prefill_token_s
        for i in range(num_shared, len(keys)):
            ready_s = arrival_s + (i + 1 - num_shared) * size * per_token_s
            if ready_s < self._ready_s.get(keys[i], math.inf):
                self._ready_s[keys[i]] = ready_s
        self.floor_s[request_id] = floor
        return floor

    def p90_s(self, request_ids: Sequence[str]) -> float | None:
        """The floors' P90 over ``request_ids`` (the measured ones); None for none."""
        floors = sorted(self.floor_s[r] for r in request_ids)
        return percentile(floors, 0.9) if floors else None
