"""Blocks this router just sent to a worker, before that worker's KV events confirm them.

A prompt's blocks reach the index only once the worker has computed them and its STORED
events have arrived: a prefill later (about 0.2 s for a 6,000-token prompt on an H100,
seconds when the prompt waits in a queue). A request sharing that prompt's prefix that is
placed in between sees no worker holding it and goes wherever load says. A burst on a new
prefix then scatters: several workers prefill the same prefix (hits lost, caches filled
with copies), and the copies fall unevenly, so some workers end up carrying two groups
and others none (docs/benchmarks.md, "Routing comparison").

So placement remembers the leading blocks of each prompt it sends to a worker, and the
index counts them as held there (`BlockIndex.match_prefix`) until the worker's STORED
event for the block arrives (from then on the index holds it) or until ``until_s`` passes
(the request failed, waited longer than that, or the worker does not cache it). llm-d's
precise prefix scorer does the same ("speculative" index entries with a TTL); vLLM's
production-stack prefix router goes further and routes on its own history alone.

Kept per (worker slot, block), so a block held in flight to two workers, or sent to one
worker twice, is tracked exactly. Pure: the caller passes the times (seconds on any clock
that does not go back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvflow.proto.block_hash import BlockHash

# At most this many (worker, block) records, oldest dropped first: 2**16 records of about
# 200 bytes = about 13 MB. A placement records its prompt's leading blocks (placement.py:
# up to a second of prefill, 2,307 blocks), about 450 for a 7K-token prompt: 145
# placements, 29 req/s of distinct such prompts over the 5 s TTL; past that the oldest are
# forgotten early, which only brings back the behaviour without this memory (and a worker
# confirms a prompt's blocks a prefill after its placement, 0.2 s for 7K tokens, well
# before that).
DEFAULT_MAX_RECORDS = 1 << 16


class InFlightBlocks:
    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        assert max_records > 0
        self._max_records = max_records
        # Block -> bitmask of the worker slots it is in flight to (the index's slots).
        self.masks: dict[BlockHash, int] = {}
        # (slot, block) -> when it expires; a later placement of the same block on the same
        # worker moves it.
        self._until_s: dict[tuple[int, BlockHash], float] = {}
        # Placements in the order they were made (so, with one TTL, in expiry order):
        # (until_s, slot, blocks). An entry whose record was confirmed or moved is skipped.
        self._placements: deque[tuple[float, int, tuple[BlockHash, ...]]] = deque()
        self._num_queued = 0  # blocks in _placements: bounds the memory, records or not

    def __len__(self) -> int:
        """(worker, block) records in flight."""
        return len(self._until_s)

    def add(self, slot: int, block_hashes: Iterable[BlockHash], until_s: float) -> None:
        """The blocks were just sent to the worker in ``slot``; they count until ``until_s``."""
        blocks = tuple(block_hashes)
        if not blocks:
            return
        bit = 1 << slot
        for block_hash in blocks:
            self._until_s[(slot, block_hash)] = until_s
            self.masks[block_hash] = self.masks.get(block_hash, 0) | bit
        self._placements.append((until_s, slot, blocks))
        self._num_queued += len(blocks)
        while self._num_queued > self._max_records:
            self._pop_oldest()

    def confirm(self, slot: int, block_hash: BlockHash) -> None:
        """The worker in ``slot`` stored the block (a STORED event): the index has it now."""
        if (slot, block_hash) in self._until_s:
            self._drop(slot, block_hash)

    def expire(self, now_s: float) -> None:
        """Forget the placements whose time is up at ``now_s``."""
        while self._placements and self._placements[0][0] <= now_s:
            self._pop_oldest()

    def forget(self, slot: int) -> None:
        """Everything in flight to the worker in ``slot`` (it cleared its cache, restarted
        or left). O(records); this happens on a snapshot or a worker leaving, not per request."""
        for key in [key for key in self._until_s if key[0] == slot]:
            self._drop(*key)

    def _pop_oldest(self) -> None:
        until_s, slot, blocks = self._placements.popleft()
        self._num_queued -= len(blocks)
        for block_hash in blocks:
            if self._until_s.get((slot, block_hash)) == until_s:
                self._drop(slot, block_hash)

    def _drop(self, slot: int, block_hash: BlockHash) -> None:
        del self._until_s[(slot, block_hash)]
        mask = self.masks[block_hash] & ~(1 << slot)
        if mask:
            self.masks[block_hash] = mask
        else:
            del self.masks[block_hash]
