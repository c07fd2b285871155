"""Which worker caches which block hash, fed by the workers' KV event streams.

Layout: one dict from block hash to a bitmask of the workers holding it (one bit per
worker slot). Matching a prompt walks its block hashes once and ANDs masks, so the cost is
O(prompt blocks + workers), never blocks x workers; the alternative, one hash set per
worker probed per block, costs 512 x 16 = 8,192 lookups for an 8k-token prompt on 16
workers instead of 512. Python ints are arbitrary precision, so slots are unbounded, and an
AND over 64 workers is still one machine word.

Bounded: each worker holds at most ``max_blocks_per_worker`` entries, oldest dropped first.
A worker never caches more blocks than it has, so the bound only bites when removal events
were lost; a fresh snapshot then puts the worker's view right again.

Blocks placement just sent to a worker count as held there too, until the worker's STORED
event confirms them or their time is up (`in_flight.InFlightBlocks`; why: that module).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvflow.proto.block_hash import BlockHash
from kvflow.router.routing.in_flight import InFlightBlocks
from kvflow.router.routing.types import WorkerId

# 2**18 blocks = 4M tokens at 16 tokens a block. An H200 with 100 GB of KV for Llama-3-8B
# (2 MiB a block) holds about 50k blocks, so this is 5x headroom; at about 200 bytes an
# entry, 16 full workers cost the router about 800 MB, so the default stays well below.
DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 18


class BlockIndex:
    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        assert max_blocks_per_worker > 0
        self._max_blocks_per_worker = max_blocks_per_worker
        self._holders: dict[BlockHash, int] = {}  # block -> bitmask of worker slots
        # Insertion-ordered, so the bound drops a worker's oldest blocks first.
        self._blocks: dict[WorkerId, dict[BlockHash, None]] = {}
        self._slot_of: dict[WorkerId, int] = {}
        self._worker_at: dict[int, WorkerId] = {}
        self._free_slots: list[int] = []
        self._in_flight = InFlightBlocks()

    # -- updates from a worker's event stream ------------------------------------------------

    def _slot(self, worker_id: WorkerId) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[worker_id] = slot
            self._worker_at[slot] = worker_id
            self._blocks[worker_id] = {}
        return slot

    def add(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """Blocks the worker stored (a STORED event); any of them in flight there are
        confirmed."""
        slot = self._slot(worker_id)
        bit = 1 << slot
        owned = self._blocks[worker_id]
        in_flight = self._in_flight if self._in_flight else None
        for block_hash in block_hashes:
            if in_flight is not None:
                in_flight.confirm(slot, block_hash)
            if block_hash in owned:
                continue
            owned[block_hash] = None
            self._holders[block_hash] = self._holders.get(block_hash, 0) | bit
        while len(owned) > self._max_blocks_per_worker:
            oldest = next(iter(owned))
            self._forget(worker_id, bit, oldest)

    def _forget(self, worker_id: WorkerId, bit: int, block_hash: BlockHash) -> None:
        del self._blocks[worker_id][block_hash]
        mask = self._holders[block_hash] & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            del self._holders[block_hash]

    def remove(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """Blocks the worker evicted (a REMOVED event); unknown hashes are ignored."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        owned = self._blocks[worker_id]
        for block_hash in block_hashes:
            if block_hash in owned:
                self._forget(worker_id, 1 << slot, block_hash)

    def clear(self, worker_id: WorkerId) -> None:
        """The worker dropped its whole cache (a CLEARED event); its slot stays. What was
        in flight to it is forgotten too: this also starts a snapshot (a restart, a gap)."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        self._in_flight.forget(slot)
        for block_hash in list(self._blocks[worker_id]):
            self._forget(worker_id, 1 << slot, block_hash)

    def replace(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """A snapshot: exactly these blocks, whatever was known before (a restart, a gap)."""
        self.clear(worker_id)
        self.add(worker_id, block_hashes)

    def drop_worker(self, worker_id: WorkerId) -> None:
        """The worker left the pool: forget its blocks and free its slot."""
        if worker_id not in self._slot_of:
            return
        self.clear(worker_id)
        slot = self._slot_of.pop(worker_id)
        del self._worker_at[slot]
        del self._blocks[worker_id]
        self._free_slots.append(slot)

    # -- what placement just sent ---------------------------------------------------------------

    def add_in_flight(
        self, worker_id: WorkerId, block_hashes: Iterable[BlockHash], until_s: float
    ) -> None:
        """Placement just sent a prompt with these leading blocks to the worker: count them
        as held there until its STORED events confirm them, or until ``until_s``."""
        slot = self._slot(worker_id)
        owned = self._blocks[worker_id]
        self._in_flight.add(slot, (h for h in block_hashes if h not in owned), until_s)

    def drop_in_flight(self, worker_id: WorkerId, block_hashes: Iterable[BlockHash]) -> None:
        """Placement's claim that these blocks are on their way to the worker is void (the
        request failed there)."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        for block_hash in block_hashes:
            self._in_flight.confirm(slot, block_hash)

    def expire_in_flight(self, now_s: float) -> None:
        self._in_flight.expire(now_s)

    def num_in_flight(self) -> int:
        """(worker, block) pairs in flight, not yet confirmed."""
        return len(self._in_flight)

    # -- queries -------------------------------------------------------------------------------

    def num_blocks(self, worker_id: WorkerId) -> int:
        return len(self._blocks.get(worker_id, ()))

    def __len__(self) -> int:
        """Distinct block hashes held by any worker."""
        return len(self._holders)

    def match_prefix(
        self, block_hashes: Iterable[BlockHash], worker_ids: Iterable[WorkerId]
    ) -> dict[WorkerId, int]:
        """For each of ``worker_ids``, how many leading blocks of the prompt it holds, or
        will hold once the requests in flight to it are prefilled.

        Consumes ``block_hashes`` only until no candidate holds the next block.
        """
        matched = dict.fromkeys(worker_ids, 0)
        active = 0
        for worker_id in matched:
            slot = self._slot_of.get(worker_id)
            if slot is not None:
                active |= 1 << slot
        depth = 0
        if not active:
            return matched  # nobody indexed: do not hash even one block
        holders = self._holders
        in_flight = self._in_flight.masks
        for block_hash in block_hashes:
            held = holders.get(block_hash, 0)
            if in_flight:
                held |= in_flight.get(block_hash, 0)
            still = held & active
            if still != active:
                self._record_depth(active & ~still, depth, matched)
                active = still
                if not active:
                    break
            depth += 1
        self._record_depth(active, depth, matched)
        return matched

    def _record_depth(self, mask: int, depth: int, matched: dict[WorkerId, int]) -> None:
        while mask:
            low_bit = mask & -mask
            matched[self._worker_at[low_bit.bit_length() - 1]] = depth
            mask ^= low_bit
