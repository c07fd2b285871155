"""The KV block pool: reference counts, a free queue in eviction order, the prefix-cache map.

Only the KV cache manager talks to the pool; the scheduler never does (STYLE.md, item 2).

A block is in exactly one of three states:
- referenced (ref_cnt > 0): in use by one or more requests; never in the free queue;
- free and cached (ref_cnt == 0, block_hash set): in the free queue *and* the hash map, so a
  later request can revive it until it is evicted;
- free and empty: in the free queue only.

The free queue is an OrderedDict keyed by block id: O(1) removal of a cached block revived
from the middle (a deque would be O(n)), O(1) pop from the head. Allocation takes the head,
so the head is the next victim: empty blocks are put at the head (they hold nothing worth
keeping), cached blocks at the tail (least recently freed evicted first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvflow.engine_worker.core.kv_events import KvEventKind, KvEventLog
from kvflow.proto.block_hash import BlockHash

# What a cached block holds, checked on every prefix hit (kv_cache_manager.py): how the
# salt entered its hash (None: it did not), the block it follows (id and incarnation;
# None for a first block) and its tokens.
BlockIdentity = tuple[object, tuple[int, int] | None, tuple[int, ...]]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    identity: BlockIdentity | None = None  # set with block_hash
    incarnation: int = 0  # +1 each time the block is cached under a hash

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.events = KvEventLog()

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (empty, or cached but unreferenced)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def free_queue_ids(self) -> list[int]:
        """Block ids in the order allocations will take them (for tests and debugging)."""
        return list(self._free)

    # -- mutations -----------------------------------------------------------------------

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a request reuses, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting cached ones.

        The caller checks ``num_free_blocks`` first; asking for more is a bug.
        """
        assert num_blocks <= len(self._free), f"allocate({num_blocks}) with {len(self._free)} free"
        taken: list[KVCacheBlock] = []
        evicted: list[BlockHash] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        self.events.record(KvEventKind.REMOVED, evicted)
        return taken

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching zero join the free queue in that order, so a caller that frees a
        request's blocks tail-first makes its tail the first to be evicted and keeps the
        shared prefix longest.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(
        self, block: KVCacheBlock, block_hash: BlockHash, identity: BlockIdentity | None = None
    ) -> bool:
        """Register a full, computed block under its chain hash.

        Returns False when another block already holds that hash (two requests computed
        the same prefix at once): this block then stays uncached and is reused as empty.
        """
        assert block.ref_cnt > 0 and block.block_hash is None
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.identity = identity
        block.incarnation += 1
        self._cached[block_hash] = block
        self.events.record(KvEventKind.STORED, [block_hash])
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.events.record(KvEventKind.CLEARED, [])
        return True
