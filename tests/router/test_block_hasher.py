"""The memoized hasher gives exactly the chain's hashes, hits or misses."""

from __future__ import annotations

import random

import pytest

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.router.routing.block_hasher import CachedBlockHasher

SEED = make_hash_seed("m")


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_equal_to_the_chain_randomized(block_size: int) -> None:
    rng = random.Random(block_size)
    hasher = CachedBlockHasher(max_entries=64)  # small: evictions happen too
    shared = [rng.randrange(49152) for _ in range(200)]
    for _ in range(300):
        length = rng.randrange(0, 200)
        tokens = (
            shared[:length] if rng.random() < 0.5 else [rng.randrange(9) for _ in range(length)]
        )
        salt = rng.choice(["", "a", "tenant-b"])
        public = rng.choice([0, 1, 3, 50])
        kw = {"block_size": block_size, "seed": SEED, "salt": salt, "num_public_blocks": public}
        assert list(hasher.iter_hashes(tokens, **kw)) == block_hashes(tokens, **kw)
    assert hasher.num_hits > 0 and hasher.num_misses > 0
    assert len(hasher) <= 64


def test_seed_and_salt_are_part_of_the_key() -> None:
    hasher = CachedBlockHasher()
    tokens = list(range(64))
    other_seed = make_hash_seed("other")
    for seed, salt in [(SEED, ""), (other_seed, ""), (SEED, "x"), (other_seed, "x")]:
        got = list(hasher.iter_hashes(tokens, block_size=16, seed=seed, salt=salt))
        assert got == block_hashes(tokens, block_size=16, seed=seed, salt=salt)


def test_lazy_and_repeat_hits() -> None:
    hasher = CachedBlockHasher()
    tokens = list(range(160))
    first = hasher.iter_hashes(tokens, block_size=16, seed=SEED)
    next(first)
    assert hasher.num_misses == 1  # one block hashed so far
    list(hasher.iter_hashes(tokens, block_size=16, seed=SEED))
    # The first pass stopped at block 0 (no worker held it): hashed, not kept.
    assert (hasher.num_hits, hasher.num_misses) == (0, 11)
    list(hasher.iter_hashes(tokens, block_size=16, seed=SEED))
    assert (hasher.num_hits, hasher.num_misses) == (10, 11)


def test_only_blocks_the_caller_went_past_are_kept() -> None:
    """A prompt's first block that no worker holds (the caller stops there) is not
    remembered; every block before it is."""
    hasher = CachedBlockHasher()
    tokens = list(range(160))
    walk = hasher.iter_hashes(tokens, block_size=16, seed=SEED)
    for _ in range(4):  # blocks 0-3 held, block 3 the first missing: the caller stops
        next(walk)
    assert len(hasher) == 3
    walk.close()
    assert len(hasher) == 3


def test_equal_seeds_share_one_object() -> None:
    hasher = CachedBlockHasher()
    for start in (0, 1000):  # two prompts, so both requests store keys
        seed = bytes(bytearray(SEED))  # equal, a new object, as from every protobuf
        list(hasher.iter_hashes(list(range(start, start + 48)), block_size=16, seed=seed))
    seeds = {id(key[1]) for key in hasher._hashes}
    assert len(hasher) == 6 and len(seeds) == 1
