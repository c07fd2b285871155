"""The ideal-hit arm: one prefix cache shared by every worker, as large as all of theirs.

A prompt block counts as cached when an earlier request (in arrival order) had it and it
has not been pushed out of one LRU cache holding ``capacity_blocks`` (the cluster's total
KV blocks): the hits of perfect placement, where no block is ever held twice and every
request finds every cached block of its prompt. No router over real, separate caches of
the same total size hits more (up to LRU's own choices). ``None`` makes it infinite, the
hit rate a trace's README quotes. The ideal arm's workers charge no prefill time for those
tokens (``DiscountedTiming``) while still holding their KV like any request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.sim.timing import step_shape
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.step_model import StepTiming


class GlobalPrefixCache:
    def __init__(self, capacity_blocks: int | None = None) -> None:
        assert capacity_blocks is None or capacity_blocks > 0
        self._capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def lookup_and_add(
        self, block_hashes: Iterable[BlockHash], num_prompt_tokens: int, block_size: int
    ) -> int:
        """Prompt tokens the shared cache serves (whole leading blocks, never the last
        prompt token, as in the engine); then the prompt's blocks become the most recent."""
        hashes = list(block_hashes)
        max_blocks = (num_prompt_tokens - 1) // block_size
        num_hit = 0
        for block_hash in hashes[:max_blocks]:
            if block_hash not in self._blocks:
                break
            num_hit += 1
        for block_hash in hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        if self._capacity_blocks is not None:
            while len(self._blocks) > self._capacity_blocks:
                self._blocks.popitem(last=False)
        return num_hit * block_size


class DiscountedTiming:
    """A step timing that charges nothing for the listed requests' leading tokens."""

    def __init__(self, timing: StepTiming, free_tokens: dict[str, int]) -> None:
        self.timing = timing
        self.free_tokens = free_tokens

    def step_s(self, output: SchedulerOutput) -> float:
        if not output.scheduled:
            return 0.0
        return self.timing.shape_s(step_shape(output, self.free_tokens))
