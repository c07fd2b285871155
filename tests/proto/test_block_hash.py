"""Golden vectors for the block-hash chain: routers and workers must hash identically.

If a vector changes, every router's index silently stops matching older workers: bump
HASH_VERSION in kvflow.proto.block_hash and update the vectors in the same commit.
"""

import hashlib
import struct

import pytest

from kvflow.proto.block_hash import (
    block_hashes,
    hash_first_block,
    hash_next_block,
    iter_block_hashes,
    make_hash_seed,
)

SEED = make_hash_seed("tiny-llama", "tok-v1")


def test_seed_golden() -> None:
    assert SEED.hex() == "5f9fe38e61d65e68711d8a3a11d3ad8a"


@pytest.mark.parametrize(
    ("tokens", "salt", "expected"),
    [
        (list(range(32)), "", [14981982807189452250, 2542470666991197927]),
        (list(range(32)), "tenant-a", [7861893779043429585, 11840707316285989474]),
        (list(range(40)), "", [14981982807189452250, 2542470666991197927]),  # 8 spare tokens
        (list(range(15)), "", []),  # no full block
    ],
)
def test_golden_vectors(tokens: list[int], salt: str, expected: list[int]) -> None:
    assert block_hashes(tokens, block_size=16, seed=SEED, salt=salt) == expected


def test_matches_an_independent_reading_of_the_spec() -> None:
    tokens = [7, 300, 49151, 0] * 8
    first = b"\x00" + struct.pack("<I", len(SEED)) + SEED + struct.pack("<I", 1) + b"s"
    h0 = hashlib.blake2b(first + struct.pack("<16I", *tokens[:16]), digest_size=8).digest()
    nxt = b"\x01" + h0 + struct.pack("<16I", *tokens[16:])
    h1 = hashlib.blake2b(nxt, digest_size=8).digest()
    expected = [int.from_bytes(h0, "little"), int.from_bytes(h1, "little")]
    assert block_hashes(tokens, block_size=16, seed=SEED, salt="s") == expected


def test_chain_depends_on_every_earlier_block() -> None:
    a = block_hashes([1] * 16 + [2] * 16, block_size=16, seed=SEED)
    b = block_hashes([3] * 16 + [2] * 16, block_size=16, seed=SEED)
    assert a[1] != b[1]


def test_seed_and_salt_are_length_prefixed() -> None:
    tokens = list(range(16))
    assert hash_first_block(b"ab", "c", tokens) != hash_first_block(b"a", "bc", tokens)
    assert make_hash_seed("ab", "c") != make_hash_seed("a", "bc")


def test_incremental_hashing_continues_the_chain() -> None:
    tokens = list(range(100))
    full = block_hashes(tokens, block_size=8, seed=SEED)
    tail = list(iter_block_hashes(tokens, block_size=8, seed=SEED, parent=full[4], start_block=5))
    assert full[5:] == tail
    assert hash_next_block(full[0], tokens[8:16]) == full[1]


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], block_size=0, seed=SEED)
    with pytest.raises(ValueError, match="parent"):
        list(iter_block_hashes([1] * 32, block_size=16, seed=SEED, start_block=1))


def test_public_prefix_is_shared_and_the_private_rest_is_salted() -> None:
    tokens = list(range(64))
    public = block_hashes(tokens, block_size=16, seed=SEED)
    a = block_hashes(tokens, block_size=16, seed=SEED, salt="a", num_public_blocks=2)
    b = block_hashes(tokens, block_size=16, seed=SEED, salt="b", num_public_blocks=2)
    assert a[:2] == b[:2] == public[:2]
    assert a[2] != b[2] and a[2] != public[2] and a[3] != b[3]
    assert a == [public[0], public[1], 11347652696708362294, 11352207427868407983]  # golden
    assert block_hashes(tokens, block_size=16, seed=SEED, salt="a", num_public_blocks=0) == (
        block_hashes(tokens, block_size=16, seed=SEED, salt="a")
    )
    # Incremental hashing past the public prefix continues the salted chain.
    tail = list(
        iter_block_hashes(
            tokens,
            block_size=16,
            seed=SEED,
            salt="a",
            num_public_blocks=2,
            parent=a[1],
            start_block=2,
        )
    )
    assert tail == a[2:]
