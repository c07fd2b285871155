"""The narrow facade the scheduler uses for KV memory (STYLE.md, item 2).

``get_computed_blocks`` finds a request's cached prefix, ``allocate_slots`` reserves room
for the tokens a step will compute (None when it cannot), ``commit`` registers the blocks
those tokens filled once the step has written them, ``free`` releases a request.
The scheduler never sees the free queue or the hash map.

A block enters the prefix cache (and a STORED event goes out) only in ``commit``, after its
KV exists: a step that fails, or a remote transfer that never lands, leaves nothing cached
that another request could reuse (STYLE.md, item 18).

**A hit is verified, not trusted to the hash.** Block hashes are 64 bits (the router's
index and the KV events share them; block_hash.py): at a million cached blocks a
collision is about 5e-8 likely per worker, and across a fleet, months and salted tenants
"unlikely" is not "never", and a collision would serve one tenant another's KV. So each
cached block keeps its identity: its tokens, how the tenant's salt entered its hash, and
the exact block it follows (id and incarnation). A lookup walks the chain and accepts a
block only when all three match the request's, so a hit is the same tokens after the same
verified prefix under the same salt, whatever the hashes say; a mismatch is a miss and is
counted (``PrefixCacheStats.num_hash_mismatches``). It costs a 16-token tuple compare per
hit block (about 1 us) and the tokens' tuple per cached block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine_worker.core.block_pool import BlockIdentity, BlockPool, KVCacheBlock
from kvflow.engine_worker.core.request import Request
from kvflow.proto.block_hash import iter_block_hashes


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were hits."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_hash_mismatches: int = 0  # a cached block's hash matched, its identity did not

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        hash_seed: bytes,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self.stats = PrefixCacheStats()

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its known tokens."""
        known = len(request.block_hashes)
        if (known + 1) * self.block_size > request.num_tokens:
            return
        parent = request.block_hashes[-1] if known else None
        request.block_hashes.extend(
            iter_block_hashes(
                request.token_ids,
                block_size=self.block_size,
                seed=self.hash_seed,
                salt=request.cache_salt,
                num_public_blocks=request.num_public_blocks,
                parent=parent,
                start_block=known,
            )
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached chain of the request's leading blocks, and its length in tokens.

        The last token is never served from cache: the step must compute it to get logits,
        so a fully cached prompt of 32 tokens with blocks of 16 reuses 1 block, not 2. A
        prefill-only request (PD) samples nothing, so all its blocks may be hits.
        No reference is taken; pass the blocks to ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request)
        num_needing_logits = 0 if request.is_prefill_only else 1
        max_blocks = (request.num_tokens - num_needing_logits) // self.block_size
        hits: list[KVCacheBlock] = []
        previous: KVCacheBlock | None = None
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            if block.identity != self._identity(request, i, previous):
                self.stats.num_hash_mismatches += 1
                break
            hits.append(block)
            previous = block
        if request.num_preemptions == 0:
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Reserve blocks so that ``num_new_tokens`` more tokens fit after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits found at admission (they extend
        ``request.num_computed_tokens``). Returns the newly allocated blocks, or None, with
        nothing changed, when the pool cannot supply them. Nothing is cached here: call
        ``commit`` once the tokens' KV is written. ``num_new_tokens`` is 0 only for a
        request whose every needed block was a hit (a prefill-only request).
        """
        assert num_new_tokens >= 1 or new_computed_blocks is not None
        hits = new_computed_blocks or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held) - len(hits)
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)  # hits that leave the free queue
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None

        self.pool.touch(hits)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks = self._blocks.setdefault(request.request_id, [])
        blocks.extend(hits)
        blocks.extend(new_blocks)
        num_cached = self._num_cached_blocks.get(request.request_id, 0) + len(hits)
        self._num_cached_blocks[request.request_id] = num_cached
        return new_blocks

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """The KV of the request's first ``num_computed_tokens`` tokens is now written:
        register every full block among them in the prefix cache (STORED events)."""
        if not self.enable_prefix_caching or request.request_id not in self._blocks:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self._update_hashes(request)
        blocks = self._blocks[request.request_id]
        for i in range(start, num_full):
            # The block this one follows is the one cached under the previous hash (this
            # request's own, or an equal one another request cached first).
            previous = self.pool.get_cached_block(request.block_hashes[i - 1]) if i else None
            identity = self._identity(request, i, previous)
            self.pool.cache_block(blocks[i], request.block_hashes[i], identity)
        self._num_cached_blocks[request.request_id] = num_full

    def _identity(self, request: Request, i: int, previous: KVCacheBlock | None) -> BlockIdentity:
        """Block ``i`` of ``request`` after ``previous`` (block_hash.hash_block decides the
        salt the same way)."""
        tokens = tuple(request.token_ids[i * self.block_size : (i + 1) * self.block_size])
        if i == 0:
            first_salt = "" if request.num_public_blocks > 0 else request.cache_salt
            return (("first", first_salt), None, tokens)
        salted = i == request.num_public_blocks and bool(request.cache_salt)
        salt = ("salted", request.cache_salt) if salted else None
        # No cached predecessor: this block can never be reached by a lookup.
        after = (previous.block_id, previous.incarnation) if previous is not None else (-1, -1)
        return (salt, after, tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (the tail is evicted before the prefix)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
