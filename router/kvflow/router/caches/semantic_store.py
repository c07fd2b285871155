"""Where the semantic cache keeps its entries: one list per scope (caches/semantic.py),
newest first, at most ``max_entries_per_scope`` long; a lookup reads the whole list and
scans it, then fetches the one answer it matched. The answers are kept apart from the list
(under the scope's key and an id), so a scan reads vectors only: about 1.5 KB an entry.

In Redis when the gateway has one (router replicas share it): a list per scope, trimmed
on every push and expiring with its newest entry, and each answer a plain key expiring
after the TTL. Else in process: scopes least recently used go first once the entries and
answers pass ``max_bytes``. An entry past its TTL is skipped on read.

An entry: its expiry, the numbers of its text, its vector (float32), its answer's id.
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

_FORMAT = 2
# A purge scans this many keys per round trip.
_PURGE_BATCH = 500


@dataclass(frozen=True)
class Entry:
    expires_s: float  # wall clock (time.time): shared by replicas through Redis
    numbers: tuple[str, ...]
    vector: tuple[float, ...]
    answer_id: str


def answer_key(scope: str, answer_id: str) -> str:
    """Under the scope's key: a purge by prefix takes the answers with the lists."""
    return f"{scope}:a:{answer_id}"


def encode_entry(entry: Entry) -> bytes:
    packed = struct.pack(f"<{len(entry.vector)}f", *entry.vector)
    row = [_FORMAT, entry.expires_s, list(entry.numbers),
           base64.b64encode(packed).decode(), entry.answer_id]  # fmt: skip
    return json.dumps(row, separators=(",", ":")).encode()


def decode_entry(data: bytes) -> Entry | None:
    """None for data this version cannot read: skipped."""
    try:
        version, expires_s, numbers, vector, answer_id = json.loads(data)
        if version != _FORMAT:
            return None
        packed = base64.b64decode(vector)
        values = struct.unpack(f"<{len(packed) // 4}f", packed)
        return Entry(float(expires_s), tuple(map(str, numbers)), values, str(answer_id))
    except (ValueError, TypeError, struct.error):
        return None


def live(raw: Sequence[bytes], now_s: float) -> list[Entry]:
    entries = (decode_entry(data) for data in raw)
    return [e for e in entries if e is not None and e.expires_s > now_s]


class VectorStore(Protocol):
    async def entries(self, scope: str) -> list[bytes]: ...

    async def answer(self, scope: str, answer_id: str) -> bytes | None: ...

    async def push(
        self, scope: str, entry: bytes, answer_id: str, answer: bytes, ttl_s: float
    ) -> None: ...

    async def purge(self, prefix: str) -> int: ...


@dataclass
class _Scope:
    entries: list[tuple[bytes, str]]  # (entry, answer id), newest first
    answers: dict[str, bytes]


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
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._clock = clock

    async def entries(self, scope: str) -> list[bytes]:
        found = self._scopes.get(scope)
        if found is None:
            return []
        self._scopes.move_to_end(scope)
        return [entry for entry, _ in found.entries]

    async def answer(self, scope: str, answer_id: str) -> bytes | None:
        found = self._scopes.get(scope)
        return None if found is None else found.answers.get(answer_id)

    async def push(
        self, scope: str, entry: bytes, answer_id: str, answer: bytes, ttl_s: float
    ) -> None:
        if len(entry) + len(answer) > self.max_bytes:
            return
        found = self._scopes.setdefault(scope, _Scope([], {}))
        self._scopes.move_to_end(scope)
        found.entries.insert(0, (entry, answer_id))
        found.answers[answer_id] = answer
        self.num_bytes += len(entry) + len(answer)
        while len(found.entries) > self.max_entries_per_scope:
            self._drop_oldest(found)
        while self.num_bytes > self.max_bytes:
            oldest_name, oldest = next(iter(self._scopes.items()))
            self._drop_oldest(oldest)
            if not oldest.entries:
                del self._scopes[oldest_name]

    def _drop_oldest(self, scope: _Scope) -> None:
        entry, answer_id = scope.entries.pop()
        self.num_bytes -= len(entry) + len(scope.answers.pop(answer_id, b""))

    async def purge(self, prefix: str) -> int:
        """Drop the scopes under ``prefix``; returns how many entries went."""
        doomed = [name for name in self._scopes if name.startswith(prefix)]
        num_entries = 0
        for name in doomed:
            scope = self._scopes[name]
            num_entries += len(scope.entries)
            while scope.entries:
                self._drop_oldest(scope)
            del self._scopes[name]
        return num_entries


class RedisVectorStore:
    def __init__(self, redis: Redis, max_entries_per_scope: int) -> None:
        self._redis = redis
        self.max_entries_per_scope = max_entries_per_scope

    async def entries(self, scope: str) -> list[bytes]:
        raw = await self._redis.lrange(scope, 0, self.max_entries_per_scope - 1)
        return [v if isinstance(v, bytes) else v.encode() for v in raw]

    async def answer(self, scope: str, answer_id: str) -> bytes | None:
        value = await self._redis.get(answer_key(scope, answer_id))
        if value is None:
            return None
        return value if isinstance(value, bytes) else value.encode()

    async def push(
        self, scope: str, entry: bytes, answer_id: str, answer: bytes, ttl_s: float
    ) -> None:
        ttl_ms = max(1, int(ttl_s * 1000))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(answer_key(scope, answer_id), answer, px=ttl_ms)
            pipe.lpush(scope, entry)
            pipe.ltrim(scope, 0, self.max_entries_per_scope - 1)  # a trimmed entry's
            pipe.pexpire(scope, ttl_ms)  # answer expires on its own
            await pipe.execute()

    async def purge(self, prefix: str) -> int:
        """Drop the lists and answers under ``prefix`` (names checked to be plain: no glob
        characters, as the exact cache's purge: caches/stores.py); returns how many
        answers went."""
        num_answers = 0
        batch: list[bytes] = []
        async for key in self._redis.scan_iter(match=prefix + "*", count=_PURGE_BATCH):
            batch.append(key)
            num_answers += b":a:" in (key if isinstance(key, bytes) else key.encode())
            if len(batch) >= _PURGE_BATCH:
                await self._redis.unlink(*batch)
                batch = []
        if batch:
            await self._redis.unlink(*batch)
        return num_answers
