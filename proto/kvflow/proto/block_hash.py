"""The one block-hash chain that routers and workers share.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks are hashed:

    h_0 = H(0x00 | seed | salt | tokens[0:B])
    h_i = H(0x01 | h_{i-1} | tokens[iB:(i+1)B])

``seed`` names the model and tokenizer (two models never share a hash), ``salt`` isolates a
tenant's cache (empty for shared, public prefixes). A request may start with
``num_public_blocks`` blocks of a prefix its pool declares public (a shared system prompt):
those are hashed with an empty salt, so every tenant shares them, and the salt enters at the
first private block instead, ``h_k = H(0x02 | h_{k-1} | salt | tokens[kB:(k+1)B])``; with
``num_public_blocks = 0`` this is the plain chain above. ``H`` is BLAKE2b cut to 64 bits: at a
million cached blocks the chance of any collision is about 1e12 / 2**64 = 5e-8, and 8-byte
ints keep the router's index small and hash with Python's dict in O(1). For the router a
collision only misroutes a request; the worker's prefix cache does not trust the hash alone
and checks each hit block's tokens, salt and predecessor (kv_cache_manager.py). Seed and salt are
length-prefixed so ("ab", "c") and ("a", "bc") differ.

Changing anything here changes every hash: bump ``HASH_VERSION`` and the golden vectors in
``tests/proto/test_block_hash.py`` together.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", int)
"""An unsigned 64-bit block hash."""

HASH_VERSION = b"kvflow-block-v1"
DEFAULT_BLOCK_SIZE = 16
_FIRST = b"\x00"
_NEXT = b"\x01"
_NEXT_SALTED = b"\x02"


def _digest(data: bytes) -> BlockHash:
    return BlockHash(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _pack_bytes(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def make_hash_seed(model_id: str, tokenizer_id: str = "") -> bytes:
    """The chain's seed for a model: workers publish it, routers copy it from them."""
    return hashlib.blake2b(
        HASH_VERSION + _pack_bytes(model_id.encode()) + _pack_bytes(tokenizer_id.encode()),
        digest_size=16,
    ).digest()


def hash_first_block(seed: bytes, salt: str, token_ids: Sequence[int]) -> BlockHash:
    return _digest(
        _FIRST + _pack_bytes(seed) + _pack_bytes(salt.encode()) + _pack_tokens(token_ids)
    )


def hash_next_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return _digest(_NEXT + struct.pack("<Q", parent) + _pack_tokens(token_ids))


def hash_next_block_salted(parent: BlockHash, salt: str, token_ids: Sequence[int]) -> BlockHash:
    """The first private block after a public prefix: the salt joins the chain here."""
    return _digest(
        _NEXT_SALTED
        + struct.pack("<Q", parent)
        + _pack_bytes(salt.encode())
        + _pack_tokens(token_ids)
    )


def hash_block(
    index: int,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    *,
    seed: bytes,
    salt: str = "",
    num_public_blocks: int = 0,
) -> BlockHash:
    """Block ``index`` of a chain whose block ``index - 1`` hashed to ``parent``.

    The one place that decides where the salt enters. A caller that memoizes must key on
    every argument (``parent``, ``seed``, ``salt``, ``token_ids``, whether ``index`` is 0,
    and whether it is below, at, or past ``num_public_blocks``).
    """
    if parent is None:
        return hash_first_block(seed, "" if index < num_public_blocks else salt, token_ids)
    if index == num_public_blocks and salt:
        return hash_next_block_salted(parent, salt, token_ids)
    return hash_next_block(parent, token_ids)


def iter_block_hashes(
    token_ids: Sequence[int],
    *,
    block_size: int,
    seed: bytes,
    salt: str = "",
    num_public_blocks: int = 0,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> Iterator[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on, lazily.

    ``parent`` is the hash of block ``start_block - 1`` (None when starting at 0), so a
    caller whose sequence grows hashes only its new blocks. Lazy, so a router can stop at
    the first block no worker holds.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (start_block == 0) != (parent is None):
        raise ValueError("pass parent exactly when start_block > 0")
    if num_public_blocks < 0:
        raise ValueError(f"num_public_blocks must be >= 0, got {num_public_blocks}")
    num_full_blocks = len(token_ids) // block_size
    for i in range(start_block, num_full_blocks):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(
            i, parent, block, seed=seed, salt=salt, num_public_blocks=num_public_blocks
        )
        yield parent


def block_hashes(
    token_ids: Sequence[int],
    *,
    block_size: int,
    seed: bytes,
    salt: str = "",
    num_public_blocks: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``."""
    return list(
        iter_block_hashes(
            token_ids,
            block_size=block_size,
            seed=seed,
            salt=salt,
            num_public_blocks=num_public_blocks,
        )
    )
