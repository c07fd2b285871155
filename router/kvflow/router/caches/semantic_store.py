"""Where the semantic cache keeps its entries: one list per scope (caches/semantic.py),
newest first, at most ``max_entries_per_scope`` long; a lookup reads the whole list and
scans it. In Redis when the gateway has one (router replicas share it: a list per scope,
trimmed on every push, expiring with its newest entry), else in process (scopes least
recently used go first once past ``max_bytes``). An entry past its TTL is skipped on read.

An entry: its expiry, the numbers of its text, its vector (float32), the stored answer
(caches/answer.py's encoding).
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

_FORMAT = 1
# A purge scans this many keys per round trip.
_PURGE_BATCH = 500


@dataclass(frozen=True)
class Entry:
    expires_s: float  # wall clock (time.time): shared by replicas through Redis
    numbers: tuple[str, ...]
    vector: tuple[float, ...]
    answer: bytes


def encode_entry(entry: Entry) -> bytes:
    packed = struct.pack(f"<{len(entry.vector)}f", *entry.vector)
    row = [
        _FORMAT,
        entry.expires_s,
        list(entry.numbers),
        base64.b64encode(packed).decode(),
        base64.b64encode(entry.answer).decode(),
    ]
    return json.dumps(row, separators=(",", ":")).encode()


def decode_entry(data: bytes) -> Entry | None:
    """None for data this version cannot read: skipped."""
    try:
        version, expires_s, numbers, vector, answer = json.loads(data)
        if version != _FORMAT:
            return None
        packed = base64.b64decode(vector)
        values = struct.unpack(f"<{len(packed) // 4}f", packed)
        return Entry(float(expires_s), tuple(map(str, numbers)), values, base64.b64decode(answer))
    except (ValueError, TypeError, struct.error):
        return None


class VectorStore(Protocol):
    async def entries(self, scope: str) -> list[bytes]: ...

    async def push(self, scope: str, entry: bytes, ttl_s: float) -> None: ...

    async def purge(self, prefix: str) -> int: ...


def live(raw: Sequence[bytes], now_s: float) -> list[Entry]:
    entries = (decode_entry(data) for data in raw)
    return [e for e in entries if e is not None and e.expires_s > now_s]


class MemoryVectorStore:
    def __init__(
        self,
        max_entries_per_scope: int,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries_per_scope = max_entries_per_scope
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._scopes: OrderedDict[str, list[bytes]] = OrderedDict()
        self._clock = clock

    async def entries(self, scope: str) -> list[bytes]:
        found = self._scopes.get(scope)
        if found is None:
            return []
        self._scopes.move_to_end(scope)
        return list(found)

    async def push(self, scope: str, entry: bytes, ttl_s: float) -> None:
        if len(entry) > self.max_bytes:
            return
        found = self._scopes.setdefault(scope, [])
        self._scopes.move_to_end(scope)
        found.insert(0, entry)
        self.num_bytes += len(entry)
        while len(found) > self.max_entries_per_scope:
            self.num_bytes -= len(found.pop())
        while self.num_bytes > self.max_bytes:
            oldest_scope, oldest = next(iter(self._scopes.items()))
            self.num_bytes -= len(oldest.pop())
            if not oldest:
                del self._scopes[oldest_scope]

    async def purge(self, prefix: str) -> int:
        """Drop the scopes under ``prefix``; returns how many entries went."""
        doomed = [scope for scope in self._scopes if scope.startswith(prefix)]
        num_entries = 0
        for scope in doomed:
            entries = self._scopes.pop(scope)
            num_entries += len(entries)
            self.num_bytes -= sum(len(e) for e in entries)
        return num_entries


class RedisVectorStore:
    def __init__(self, redis: Redis, max_entries_per_scope: int) -> None:
        self._redis = redis
        self.max_entries_per_scope = max_entries_per_scope

    async def entries(self, scope: str) -> list[bytes]:
        raw = await self._redis.lrange(scope, 0, self.max_entries_per_scope - 1)
        return [v if isinstance(v, bytes) else v.encode() for v in raw]

    async def push(self, scope: str, entry: bytes, ttl_s: float) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.lpush(scope, entry)
            pipe.ltrim(scope, 0, self.max_entries_per_scope - 1)
            pipe.pexpire(scope, max(1, int(ttl_s * 1000)))
            await pipe.execute()

    async def purge(self, prefix: str) -> int:
        """Drop the scopes under ``prefix`` (names checked to be plain: no glob characters,
        as the exact cache's purge: caches/stores.py); returns how many entries went."""
        num_entries = 0
        async for scope in self._redis.scan_iter(match=prefix + "*", count=_PURGE_BATCH):
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.llen(scope)
                pipe.unlink(scope)
                length, _ = await pipe.execute()
            num_entries += int(length)
        return num_entries
