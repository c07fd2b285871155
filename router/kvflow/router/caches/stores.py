"""Where answers are kept: Redis when the gateway has one (router replicas share it), else
an in-process LRU bounded in bytes. Both expire entries after the TTL; both answer a
purge by key prefix (caches/key.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from redis.asyncio import Redis

# A purge deletes in batches of this many keys per round trip.
_PURGE_BATCH = 500


class AnswerStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def purge(self, prefix: str) -> int: ...


class MemoryAnswerStore:
    """Bounded in bytes (keys and values). Past ``max_bytes`` the owner holding the most
    bytes gives up its least recently used entry, so that one tenant's traffic cannot push
    out another's entries: while a tenant holds under its share (``max_bytes`` over the
    tenants storing), only the larger ones lose entries, and a tenant alone may use it all.
    ``owner_of`` names a key's owner (its tenant); one owner is a plain LRU."""

    def __init__(
        self,
        max_bytes: int,
        on_evict: Callable[[int], None] = lambda n: None,
        clock: Callable[[], float] = time.monotonic,
        owner_of: Callable[[str], str] = lambda key: "",
    ) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        # owner -> its entries, least recently used first: key -> (expires at, value)
        self._owners: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._owner_bytes: dict[str, int] = {}
        self._on_evict = on_evict
        self._clock = clock
        self._owner_of = owner_of

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._owners.values())

    def bytes_of(self, owner: str) -> int:
        """What ``owner``'s entries take, in bytes."""
        return self._owner_bytes.get(owner, 0)

    async def get(self, key: str) -> bytes | None:
        entries = self._owners.get(self._owner_of(key))
        entry = None if entries is None else entries.get(key)
        if entries is None or entry is None:
            return None
        expires_s, value = entry
        if self._clock() >= expires_s:
            self._drop(key)
            return None
        entries.move_to_end(key)
        return value

    def fits(self, key: str, value: bytes) -> bool:
        """Whether ``put`` would keep the entry: one larger than the whole store it drops."""
        return _size(key, value) <= self.max_bytes

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        if not self.fits(key, value):
            return
        size = _size(key, value)
        owner = self._owner_of(key)
        self._drop(key)
        num_evicted = 0
        while self.num_bytes + size > self.max_bytes:
            largest = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            self._drop(next(iter(self._owners[largest])))
            num_evicted += 1
        self._owners.setdefault(owner, OrderedDict())[key] = (self._clock() + ttl_s, value)
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self.num_bytes += size
        if num_evicted:
            self._on_evict(num_evicted)

    async def delete(self, key: str) -> bool:
        """Exactly ``key`` (api/response_store.py): whether it was there."""
        return self._drop(key)

    async def purge(self, prefix: str) -> int:
        doomed = [key for entries in self._owners.values() for key in entries
                  if key.startswith(prefix)]  # fmt: skip
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def _drop(self, key: str) -> bool:
        owner = self._owner_of(key)
        entries = self._owners.get(owner)
        if entries is None or key not in entries:
            return False
        _, value = entries.pop(key)
        size = _size(key, value)
        self.num_bytes -= size
        self._owner_bytes[owner] -= size
        if not entries:  # an owner with nothing stored is never the largest
            del self._owners[owner]
            del self._owner_bytes[owner]
        return True


def _size(key: str, value: bytes) -> int:
    return len(key.encode()) + len(value)


class RedisAnswerStore:
    """Plain strings with an expiry: Redis evicts by its own policy (maxmemory) and TTL."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(key)
        if value is None:
            return None
        return value if isinstance(value, bytes) else value.encode()

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._redis.set(key, value, px=max(1, int(ttl_s * 1000)))

    async def purge(self, prefix: str) -> int:
        # Key prefixes hold only names checked to be plain (tenants, pools, the scope), so
        # they carry no glob characters.
        num_deleted = 0
        batch: list[bytes] = []
        async for key in self._redis.scan_iter(match=prefix + "*", count=_PURGE_BATCH):
            batch.append(key)
            if len(batch) >= _PURGE_BATCH:
                num_deleted += await self._redis.unlink(*batch)
                batch = []
        if batch:
            num_deleted += await self._redis.unlink(*batch)
        return num_deleted
