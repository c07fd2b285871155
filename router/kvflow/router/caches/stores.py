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
    """Least recently used first out, once the keys and values pass ``max_bytes``."""

    def __init__(
        self,
        max_bytes: int,
        on_evict: Callable[[int], None] = lambda n: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._on_evict = on_evict
        self._clock = clock

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires_s, value = entry
        if self._clock() >= expires_s:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    def fits(self, key: str, value: bytes) -> bool:
        """Whether ``put`` would keep the entry: one larger than the whole store it drops."""
        return _size(key, value) <= self.max_bytes

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        if not self.fits(key, value):
            return
        size = _size(key, value)
        if key in self._entries:
            self._drop(key)
        num_evicted = 0
        while self.num_bytes + size > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            num_evicted += 1
        self._entries[key] = (self._clock() + ttl_s, value)
        self.num_bytes += size
        if num_evicted:
            self._on_evict(num_evicted)

    async def delete(self, key: str) -> bool:
        """Exactly ``key`` (api/response_store.py): whether it was there."""
        if key not in self._entries:
            return False
        self._drop(key)
        return True

    async def purge(self, prefix: str) -> int:
        doomed = [key for key in self._entries if key.startswith(prefix)]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def _drop(self, key: str) -> None:
        _, value = self._entries.pop(key)
        self.num_bytes -= _size(key, value)


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
