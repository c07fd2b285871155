"""Where files, batches and each line's result live: Redis (shared by router replicas, the
tenants' connection) or a directory (a volume, one router). Thin I/O shells; the records
are batch/records.py's.

Results are keyed by the line's index and written once (HSETNX, or the first line for an
index in an append-only file), so a line run twice across a restart counts once. They and a
cancel request are a running batch's progress: once its last record is stored (its files
written, its counts in it), the runner drops them (drop_progress); nothing reads them after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from redis.asyncio import Redis

from kvflow.router.batch.records import BatchRecord, Counts, FileRecord

log = logging.getLogger("kvflow.router.batch")

# A line's result: did it succeed (output file) and its line (JSON text).
Result = tuple[bool, str]


class BatchStore(Protocol):
    async def put_file(self, record: FileRecord, content: bytes) -> None: ...
    async def get_file(self, file_id: str) -> FileRecord | None: ...
    async def get_content(self, file_id: str) -> bytes | None: ...
    async def list_files(self, tenant: str) -> list[FileRecord]: ...
    async def delete_file(self, file_id: str) -> None: ...
    async def put_batch(self, record: BatchRecord) -> None: ...
    async def get_batch(self, batch_id: str) -> BatchRecord | None: ...
    async def list_batches(self, tenant: str) -> list[BatchRecord]: ...
    async def active_batch_ids(self) -> list[str]: ...
    async def request_cancel(self, batch_id: str, at_s: int) -> None: ...
    async def cancel_requested(self, batch_id: str) -> int | None: ...
    async def add_result(self, batch_id: str, index: int, ok: bool, line: str) -> None: ...
    async def results(self, batch_id: str) -> dict[int, Result]: ...
    async def counts(self, batch_id: str) -> tuple[int, int]: ...  # completed, failed
    async def drop_progress(self, batch_id: str) -> None: ...  # its results and cancel
    async def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool: ...


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def with_counts(record: BatchRecord, done: tuple[int, int]) -> Counts:
    return Counts(total=record.total, completed=done[0], failed=done[1])


# A line's result, first writer wins: into its hash (ok or err) unless the other holds it.
# One script, so two replicas storing the same line at once cannot put it in both.
# Records a listing reads per round trip.
_MGET_BATCH = 500
_ADD_RESULT = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
return redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
"""
# Take the lease, or renew it if this owner holds it. One script: a GET then a PEXPIRE
# could renew a lease that lapsed and another replica took in between.
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


class RedisBatchStore:
    """Keys under ``kvflow:batch:<scope>:``; per tenant, sets of its file and batch ids."""

    def __init__(self, redis: Redis, scope: str) -> None:
        self._r = redis
        self._p = f"kvflow:batch:{scope}:"
        self._add_result = redis.register_script(_ADD_RESULT)
        self._claim = redis.register_script(_CLAIM)

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._p + "file:" + record.id, record.dumps())
            pipe.set(self._p + "content:" + record.id, content)
            pipe.sadd(self._p + "files:" + record.tenant, record.id)
            await pipe.execute()

    async def get_file(self, file_id: str) -> FileRecord | None:
        raw = await self._r.get(self._p + "file:" + file_id)
        return None if raw is None else FileRecord.loads(raw)

    async def get_content(self, file_id: str) -> bytes | None:
        raw = await self._r.get(self._p + "content:" + file_id)
        return raw if raw is None or isinstance(raw, bytes) else raw.encode()

    async def list_files(self, tenant: str) -> list[FileRecord]:
        ids = await self._r.smembers(self._p + "files:" + tenant)
        return [FileRecord.loads(raw) for raw in await self._records("file:", ids)]

    async def _records(self, kind: str, ids: Iterable[bytes | str]) -> list[bytes | str]:
        """The stored records of ``ids`` (those still there), _MGET_BATCH a round trip: a
        tenant's listing reads every record of its, one GET each took a round trip each."""
        keys = [self._p + kind + _text(i) for i in ids]
        found: list[bytes | str] = []
        for start in range(0, len(keys), _MGET_BATCH):
            found += [r for r in await self._r.mget(keys[start:start + _MGET_BATCH])
                      if r is not None]  # fmt: skip
        return found

    async def delete_file(self, file_id: str) -> None:
        record = await self.get_file(file_id)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._p + "file:" + file_id, self._p + "content:" + file_id)
            if record is not None:
                pipe.srem(self._p + "files:" + record.tenant, file_id)
            await pipe.execute()

    async def put_batch(self, record: BatchRecord) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self._p + "batch:" + record.id, record.dumps())
            pipe.sadd(self._p + "batches:" + record.tenant, record.id)
            if record.status.is_terminal:
                pipe.srem(self._p + "active", record.id)
            else:
                pipe.sadd(self._p + "active", record.id)
            await pipe.execute()

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        raw = await self._r.get(self._p + "batch:" + batch_id)
        return None if raw is None else BatchRecord.loads(raw)

    async def list_batches(self, tenant: str) -> list[BatchRecord]:
        ids = await self._r.smembers(self._p + "batches:" + tenant)
        return [BatchRecord.loads(raw) for raw in await self._records("batch:", ids)]

    async def active_batch_ids(self) -> list[str]:
        return sorted(_text(i) for i in await self._r.smembers(self._p + "active"))

    async def request_cancel(self, batch_id: str, at_s: int) -> None:
        await self._r.set(self._p + "cancel:" + batch_id, at_s, nx=True)

    async def cancel_requested(self, batch_id: str) -> int | None:
        raw = await self._r.get(self._p + "cancel:" + batch_id)
        return None if raw is None else int(raw)

    async def add_result(self, batch_id: str, index: int, ok: bool, line: str) -> None:
        mine = self._p + ("ok:" if ok else "err:") + batch_id
        other = self._p + ("err:" if ok else "ok:") + batch_id
        await self._add_result(keys=[mine, other], args=[index, line])

    async def results(self, batch_id: str) -> dict[int, Result]:
        found: dict[int, Result] = {}
        for ok in (True, False):
            entries = await self._r.hgetall(self._p + ("ok:" if ok else "err:") + batch_id)
            for index, line in entries.items():
                found.setdefault(int(index), (ok, _text(line)))
        return found

    async def counts(self, batch_id: str) -> tuple[int, int]:
        ok = await self._r.hlen(self._p + "ok:" + batch_id)
        err = await self._r.hlen(self._p + "err:" + batch_id)
        return int(ok), int(err)

    async def drop_progress(self, batch_id: str) -> None:
        await self._r.delete(*(self._p + kind + batch_id for kind in ("ok:", "err:", "cancel:")))

    async def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        """One router replica runs a batch at a time: it holds the batch's lease, renewed
        while it runs; a replica that dies lets it lapse and another resumes the batch."""
        key = self._p + "lease:" + batch_id
        return bool(await self._claim(keys=[key], args=[owner, max(1, int(ttl_s * 1000))]))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _append_line(path: Path, entry: bytes) -> None:
    with path.open("a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end > 0:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                # A line torn by a crash (or a failed write) is ended first, and then skipped
                # as not JSON; appended to it, this line would be skipped with it, and lost.
                entry = b"\n" + entry
        f.write(entry)
        f.flush()
        os.fsync(f.fileno())


def _read_results(path: Path) -> dict[int, Result]:
    found: dict[int, Result] = {}
    if not path.exists():
        return found
    for raw in path.read_text().splitlines():
        parsed = _parse_result(raw)
        if parsed is not None:
            found.setdefault(parsed[0], (parsed[1], parsed[2]))
    return found


def _parse_result(raw: bytes | str) -> tuple[int, bool, str] | None:
    """A results file's line: index, ok, the result's line; None for a torn one (its line
    runs again)."""
    try:
        entry = json.loads(raw)
        return int(entry["i"]), bool(entry["ok"]), str(entry["line"])
    except (ValueError, TypeError, KeyError):
        return None


# Batches whose results files DirBatchStore.counts keeps a tally of; past it the oldest is
# forgotten (read whole again if asked): a tally holds an entry per line done.
_MAX_TALLIES = 256


@dataclass
class _Tally:
    """A results file read up to ``offset`` (a line's end): each index's first verdict."""

    offset: int = 0
    first: dict[int, bool] = field(default_factory=dict)


class DirBatchStore:
    """One router's store on a directory: files/, batches/, results/ (append-only JSONL, a
    torn last line from a crash is skipped), cancel/.

    counts reads only what was appended since its last call (a GET of a running batch
    counts it): a tally per batch, kept by this router, the one that writes the files."""

    def __init__(self, root: Path) -> None:
        self._root = root
        for sub in ("files", "batches", "results", "cancel"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self._lock = asyncio.Lock()  # appends from concurrent lines stay whole
        self._tallies: dict[str, _Tally] = {}

    def _path(self, kind: str, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise ValueError(f"not an id: {name!r}")
        return self._root / kind / name

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        await asyncio.to_thread(_write_atomic, self._path("files", record.id + ".data"), content)
        _write_atomic(self._path("files", record.id + ".json"), record.dumps().encode())

    async def get_file(self, file_id: str) -> FileRecord | None:
        path = self._path("files", file_id + ".json")
        return FileRecord.loads(path.read_bytes()) if path.exists() else None

    async def get_content(self, file_id: str) -> bytes | None:
        path = self._path("files", file_id + ".data")
        return await asyncio.to_thread(path.read_bytes) if path.exists() else None

    async def list_files(self, tenant: str) -> list[FileRecord]:
        found = [FileRecord.loads(p.read_bytes()) for p in (self._root / "files").glob("*.json")]
        return [f for f in found if f.tenant == tenant]

    async def delete_file(self, file_id: str) -> None:
        self._path("files", file_id + ".json").unlink(missing_ok=True)
        self._path("files", file_id + ".data").unlink(missing_ok=True)

    async def put_batch(self, record: BatchRecord) -> None:
        _write_atomic(self._path("batches", record.id + ".json"), record.dumps().encode())

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        path = self._path("batches", batch_id + ".json")
        return BatchRecord.loads(path.read_bytes()) if path.exists() else None

    def _all_batches(self) -> list[BatchRecord]:
        found = []
        for path in (self._root / "batches").glob("*.json"):
            try:
                found.append(BatchRecord.loads(path.read_bytes()))
            except (ValueError, TypeError, KeyError):  # one unreadable record hides no other
                log.error("batch store: %s is not a batch record; skipped", path)
        return found

    async def list_batches(self, tenant: str) -> list[BatchRecord]:
        return [b for b in self._all_batches() if b.tenant == tenant]

    async def active_batch_ids(self) -> list[str]:
        return sorted(b.id for b in self._all_batches() if not b.status.is_terminal)

    async def request_cancel(self, batch_id: str, at_s: int) -> None:
        path = self._path("cancel", batch_id)
        if not path.exists():
            _write_atomic(path, str(at_s).encode())

    async def cancel_requested(self, batch_id: str) -> int | None:
        path = self._path("cancel", batch_id)
        return int(path.read_text()) if path.exists() else None

    async def add_result(self, batch_id: str, index: int, ok: bool, line: str) -> None:
        entry = json.dumps({"i": index, "ok": ok, "line": line}) + "\n"
        async with self._lock:
            _append_line(self._path("results", batch_id + ".jsonl"), entry.encode())

    async def results(self, batch_id: str) -> dict[int, Result]:
        # Off the event loop: a batch's results are up to its whole output.
        return await asyncio.to_thread(_read_results, self._path("results", batch_id + ".jsonl"))

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """As results() counts them, from the lines appended since the last call."""
        path = self._path("results", batch_id + ".jsonl")
        async with self._lock:
            tally = self._tallies.pop(batch_id, None) or _Tally()
            if len(self._tallies) >= _MAX_TALLIES:
                del self._tallies[next(iter(self._tallies))]
            self._tallies[batch_id] = tally  # last: the most recently counted
            if path.exists():
                with path.open("rb") as f:
                    f.seek(tally.offset)
                    tail = f.read()
                for raw in tail.splitlines():
                    parsed = _parse_result(raw)
                    if parsed is not None:
                        tally.first.setdefault(parsed[0], parsed[1])
                # A last line without its end (torn, or valid JSON cut before its newline)
                # is read again next time, as results() would read it then.
                tally.offset += tail.rfind(b"\n") + 1
        ok = sum(tally.first.values())
        return ok, len(tally.first) - ok

    async def drop_progress(self, batch_id: str) -> None:
        async with self._lock:
            self._path("results", batch_id + ".jsonl").unlink(missing_ok=True)
            self._path("cancel", batch_id).unlink(missing_ok=True)
            self._tallies.pop(batch_id, None)

    async def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return True  # one router owns a directory
