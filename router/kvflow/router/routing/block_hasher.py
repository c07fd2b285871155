"""The prompt's block hashes for routing, memoized per block. Pure.

Every hash still comes from kvflow.proto.block_hash (the one chain); this only remembers
``(parent, block tokens) -> hash``. Routing hashes a prompt lazily until no worker holds a
block, so the blocks it hashes at all are mostly blocks some worker caches: prefixes that
earlier requests already sent. A hit costs a dict lookup on a 64-byte key (about 0.3 us)
instead of BLAKE2b through Python (about 4 us), so a fully cached 8k-token prompt (512
blocks) costs about 0.2 ms to hash instead of 2 ms. The block dispatch (first, salted,
next) is `hash_block`'s alone: the memo keys on every input that function reads.

A block's hash is remembered only once the caller asks for the next block, that is once
some worker held this one: the first block no worker holds (a new question's) is hashed
but not kept, since nobody asks for it again. Kept anyway, it was the gateway's one
steady grower in the scale check, one entry (about 415 bytes) per request
(docs/benchmarks.md, "Scale check").
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvflow.proto.block_hash import BlockHash, hash_block

# 2**17 entries of about 200 bytes (a 64-byte key, a tuple, an int) = about 25 MB, which
# remembers 2M tokens of distinct cached prefixes per router replica.
DEFAULT_MAX_ENTRIES = 1 << 17

_Key = tuple[object, ...]


class CachedBlockHasher:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        assert max_entries > 0
        self._max_entries = max_entries
        # Evicted oldest first (FIFO): a hot prefix evicted costs one re-hash, and skipping
        # LRU's move_to_end halves the cost of a hit. An OrderedDict, not a plain dict:
        # `del d[next(iter(d))]` on a dict scans the deleted slots at the front of its
        # entry table on every eviction, so once full each miss cost about 65 us at
        # 2**17 entries (600k misses: 40 s) against 0.6 us for popitem(last=False).
        self._hashes: OrderedDict[_Key, BlockHash] = OrderedDict()
        # One bytes object per hash seed: a worker's seed arrives as a new object with
        # every request, and each key would otherwise hold its own copy.
        self._seeds: dict[bytes, bytes] = {}
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._hashes)

    def _lookup(self, key: _Key) -> BlockHash | None:
        found = self._hashes.get(key)
        if found is not None:
            self.num_hits += 1
        return found

    def _store(self, key: _Key, value: BlockHash) -> None:
        self._hashes[key] = value
        if len(self._hashes) > self._max_entries:
            self._hashes.popitem(last=False)

    def iter_hashes(
        self,
        token_ids: Sequence[int],
        *,
        block_size: int,
        seed: bytes,
        salt: str = "",
        num_public_blocks: int = 0,
        keep: bool = True,
    ) -> Iterator[BlockHash]:
        """The same hashes as `iter_block_hashes(...)`, lazily. With ``keep=False`` the
        memo is read but nothing new is stored in it."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        num_full_blocks = len(token_ids) // block_size
        if num_full_blocks == 0:
            return
        # One pack for the whole prompt; a block's key is then a 64-byte slice.
        packed = array("I", token_ids[: num_full_blocks * block_size]).tobytes()
        step = 4 * block_size
        seed = self._seeds.setdefault(seed, seed)
        parent: BlockHash | None = None
        unkept: tuple[_Key, BlockHash] | None = None  # the last block hashed, not yet kept
        for i in range(num_full_blocks):
            if unkept is not None:  # the caller asked for this block: keep the one before
                self._store(*unkept)
                unkept = None
            chunk = packed[i * step : (i + 1) * step]
            # Where this block stands relative to the public prefix: -1 inside, 0 at its
            # end (the salt may enter here), 1 past it.
            position = (i > num_public_blocks) - (i < num_public_blocks)
            key: _Key = (parent, seed, salt, i == 0, position, chunk)
            found = self._lookup(key)
            if found is None:
                block = token_ids[i * block_size : (i + 1) * block_size]
                found = hash_block(
                    i, parent, block, seed=seed, salt=salt, num_public_blocks=num_public_blocks
                )
                self.num_misses += 1
                if keep:
                    unkept = (key, found)
            parent = found
            yield found
        if unkept is not None:  # the caller went on past the last block: it was held
            self._store(*unkept)


@dataclass(frozen=True)
class PromptHashes:
    """A prompt's block hashes as an iterable that starts over on every pass, each pass lazy
    and memoized: placement walks them once for decode candidates, once for prefill ones."""

    hasher: CachedBlockHasher
    token_ids: Sequence[int]
    block_size: int
    seed: bytes
    salt: str = ""
    num_public_blocks: int = 0

    def __iter__(self) -> Iterator[BlockHash]:
        return self.hasher.iter_hashes(
            self.token_ids,
            block_size=self.block_size,
            seed=self.seed,
            salt=self.salt,
            num_public_blocks=self.num_public_blocks,
        )

    def peek(self) -> Iterator[BlockHash]:
        """The hashes, remembering none the memo lacks. Placement records a placed prompt's
        leading blocks this way (in_flight.py): most of a new prompt is never asked for
        again, and a block that is (a burst's shared prefix) is remembered then."""
        return self.hasher.iter_hashes(
            self.token_ids,
            block_size=self.block_size,
            seed=self.seed,
            salt=self.salt,
            num_public_blocks=self.num_public_blocks,
            keep=False,
        )
