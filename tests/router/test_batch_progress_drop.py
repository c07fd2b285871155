"""A batch's progress (its lines' results, its cancel request) is dropped from the store
once its last record is stored, never before: the record carries its counts, a crash
before it is stored resumes the batch from its results, and a replica that finishes it
again with a stale record leaves the ended one be. The directory store counts a running
batch's results from what was appended since it last counted, as results() reads them.

On the real directory store, and the Redis store against a real redis-server; the runner
answers each line itself (its bookkeeping is what is tested)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.api.gateway import Gateway
from kvflow.router.batch.config import BatchConfig
from kvflow.router.batch.records import FILE_PURPOSE, BatchRecord, Counts, FileRecord, Status
from kvflow.router.batch.routes import BatchApi
from kvflow.router.batch.runner import BatchRunner
from kvflow.router.batch.store import DirBatchStore, RedisBatchStore
from kvflow.router.tenants.config import ANONYMOUS

CHAT = "/v1/chat/completions"


def _line(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip


class _Answering(BatchRunner):
    """Each line answered at once: 200, but 400 for a custom_id starting with "bad"."""

    def _pool_is_busy(self, record: BatchRecord, line: Any) -> bool:
        return False

    async def _answer(self, record: BatchRecord, line: Any) -> tuple[int, str, dict[str, Any]]:
        status = 400 if line.custom_id.startswith("bad") else 200
        return status, f"req-{line.index}", {"n": line.index}


def _runner(store: DirBatchStore) -> _Answering:
    config = BatchConfig(poll_interval_s=0.01, busy_backoff_s=0.01)
    return _Answering(FastAPI(), cast(Gateway, None), store, config)


async def _batch(store: DirBatchStore, custom_ids: list[str]) -> BatchRecord:
    content = "".join(json.dumps(_line(c)) + "\n" for c in custom_ids).encode()
    await store.put_file(FileRecord("file-in", "a", "in.jsonl", FILE_PURPOSE, len(content), 1),
                         content)  # fmt: skip
    record = BatchRecord("batch-1", "a", CHAT, "file-in", "24h", 1, 2**40)
    await store.put_batch(record)
    return record


async def _run_until(runner: BatchRunner, store: DirBatchStore, statuses: set[Status]) -> None:
    for _ in range(200):
        await runner.step()
        await asyncio.sleep(0.01)
        record = await store.get_batch("batch-1")
        if record is not None and record.status in statuses:
            return
    raise AssertionError(f"batch-1 still {record}")


def _progress_on_disk(root: Path, batch_id: str) -> list[str]:
    paths = (root / "results" / f"{batch_id}.jsonl", root / "cancel" / batch_id)
    return [str(p.relative_to(root)) for p in paths if p.exists()]


def test_an_ended_batch_keeps_its_counts_in_its_record_and_drops_its_results(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        store = DirBatchStore(tmp_path)
        await _batch(store, ["a", "b", "bad"])
        await _run_until(_runner(store), store, {Status.COMPLETED})
        record = await store.get_batch("batch-1")
        assert record is not None and record.final_counts == Counts(3, 2, 1)
        assert record.output_file_id is not None and record.error_file_id is not None
        assert _progress_on_disk(tmp_path, "batch-1") == []
        assert await store.results("batch-1") == {}
        output = await store.get_content(record.output_file_id)
        assert output is not None
        assert [json.loads(s)["custom_id"] for s in output.splitlines()] == ["a", "b"]
        assert await store.active_batch_ids() == []
        # Read back as stored: the counts survive the record's JSON.
        assert BatchRecord.loads(record.dumps()) == record

    asyncio.run(run())


class _Unwritable(DirBatchStore):
    """A store that fails to take an ended batch's record ``times`` times (a crash there)."""

    def __init__(self, root: Path, times: int) -> None:
        super().__init__(root)
        self.times = times

    async def put_batch(self, record: BatchRecord) -> None:
        if record.status.is_terminal and self.times > 0:
            self.times -= 1
            raise OSError("No space left on device")
        await super().put_batch(record)


def test_a_batch_whose_last_record_was_not_stored_resumes_from_its_results(
    tmp_path: Path,
) -> None:
    """The results are dropped after the record is stored, never before: a pass that fails
    to store it leaves the batch finalizing with its results, and a router restarted then
    (a new runner) writes the same files from them."""

    async def run() -> None:
        store = _Unwritable(tmp_path, times=1)
        await _batch(store, ["a", "b", "bad"])
        await _run_until(_runner(store), store, {Status.FINALIZING})
        runner = _runner(store)
        await runner.step()  # its last record refused
        record = await store.get_batch("batch-1")
        assert record is not None and record.status is Status.FINALIZING
        assert len(await store.results("batch-1")) == 3
        assert await store.active_batch_ids() == ["batch-1"]
        await _run_until(_runner(store), store, {Status.COMPLETED})
        done = await store.get_batch("batch-1")
        assert done is not None and done.final_counts == Counts(3, 2, 1)
        assert _progress_on_disk(tmp_path, "batch-1") == []

    asyncio.run(run())


def test_a_stale_finalize_leaves_an_ended_batch_as_it_ended(tmp_path: Path) -> None:
    """A replica whose lease lapsed mid-pass may finalize a batch another replica ended and
    dropped the results of: it must not write files and counts from no results."""

    async def run() -> None:
        store = DirBatchStore(tmp_path)
        await _batch(store, ["a", "b"])
        await _run_until(_runner(store), store, {Status.FINALIZING})
        stale = await store.get_batch("batch-1")
        assert stale is not None
        await _run_until(_runner(store), store, {Status.COMPLETED})
        ended = await store.get_batch("batch-1")
        assert ended is not None and ended.output_file_id is not None
        output = await store.get_content(ended.output_file_id)
        late = _runner(store)
        await late._advance(stale)  # its record read before the other ended it
        assert await store.get_batch("batch-1") == ended
        assert await store.get_content(ended.output_file_id) == output
        assert ended.final_counts == Counts(2, 2, 0)

    asyncio.run(run())


def test_a_batch_failed_on_resume_keeps_its_counts_and_drops_its_results(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        store = DirBatchStore(tmp_path)
        record = await _batch(store, ["a", "b"])
        await store.put_batch(record.moved(Status.IN_PROGRESS, 2, total=2))
        await store.add_result("batch-1", 0, True, '{"custom_id": "a"}')
        await store.delete_file("file-in")  # its lines cannot be read again
        await _run_until(_runner(store), store, {Status.FAILED})
        failed = await store.get_batch("batch-1")
        assert failed is not None and failed.final_counts == Counts(2, 1, 0)
        assert [e["code"] for e in failed.errors] == ["file_not_found"]
        assert _progress_on_disk(tmp_path, "batch-1") == []

    asyncio.run(run())


class _EndsMeanwhile(DirBatchStore):
    """The runner ends the batch (its last record stored, its progress dropped) between
    the cancel route's read of the record and its cancel request."""

    async def request_cancel(self, batch_id: str, at_s: int) -> None:
        record = await self.get_batch(batch_id)
        assert record is not None
        ended = record.moved(Status.FINALIZING, 3).moved(Status.COMPLETED, 4)
        await self.put_batch(replace(ended, final_counts=Counts(2, 2, 0)))
        await super().request_cancel(batch_id, at_s)


def test_a_cancel_that_races_the_batchs_end_leaves_no_cancel_behind(tmp_path: Path) -> None:
    async def run() -> None:
        store = _EndsMeanwhile(tmp_path)
        record = await _batch(store, ["a", "b"])
        await store.put_batch(record.moved(Status.IN_PROGRESS, 2, total=2))
        api = BatchApi(cast(Gateway, None), store, BatchConfig())
        shown = await api.cancel(replace(ANONYMOUS, name="a"), "batch-1")
        assert shown["status"] == "completed"
        assert shown["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        assert _progress_on_disk(tmp_path, "batch-1") == []

    asyncio.run(run())


def test_the_directory_store_counts_what_results_reads_from_what_was_appended(
    tmp_path: Path,
) -> None:
    """Each count reads what was appended since the last; a line stored twice counts once,
    a torn line not at all, and a line appended after a torn one is kept (it was glued to
    the torn one and lost with it: its batch ended ``expired`` with that line never run)."""

    async def run() -> None:
        store = DirBatchStore(tmp_path)
        path = tmp_path / "results" / "batch-1.jsonl"

        async def agree(expected: tuple[int, int]) -> None:
            found = await store.results("batch-1")
            ok = sum(1 for is_ok, _ in found.values() if is_ok)
            assert (ok, len(found) - ok) == expected
            assert await store.counts("batch-1") == expected

        await agree((0, 0))
        await store.add_result("batch-1", 0, True, "a")
        await agree((1, 0))
        await store.add_result("batch-1", 0, False, "again")  # a retry: first one wins
        await store.add_result("batch-1", 1, False, "b")
        await agree((1, 1))
        with path.open("a") as f:
            f.write('{"i": 2, "ok": tr')  # a crash mid-append
        await agree((1, 1))
        await store.add_result("batch-1", 3, True, "d")
        await agree((2, 1))
        assert set(await store.results("batch-1")) == {0, 1, 3}
        with path.open("a") as f:
            f.write(json.dumps({"i": 4, "ok": True, "line": "e"}))  # cut before its newline
        await agree((3, 1))
        await store.add_result("batch-1", 5, True, "f")
        await agree((4, 1))
        reopened = DirBatchStore(tmp_path)  # a restarted router counts the file afresh
        assert await reopened.counts("batch-1") == (4, 1)
        await store.request_cancel("batch-1", 7)
        await store.drop_progress("batch-1")
        assert _progress_on_disk(tmp_path, "batch-1") == []
        await agree((0, 0))
        assert await store.cancel_requested("batch-1") is None

    asyncio.run(run())


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.mark.integration
def test_the_redis_store_drops_a_batchs_results_and_cancel(redis_server: RedisServer) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            store = RedisBatchStore(redis, "drop")
            for batch_id in ("batch-1", "batch-2"):
                await store.add_result(batch_id, 0, True, "a")
                await store.add_result(batch_id, 1, False, "b")
                await store.request_cancel(batch_id, 7)
            assert await store.claim("batch-1", "me", 30)

            async def keys(batch_id: str) -> set[str]:
                found = await redis.keys(f"kvflow:batch:drop:*:{batch_id}")
                names = [k.decode() if isinstance(k, bytes) else k for k in found]
                return {name.split(":")[-2] for name in names}

            assert await keys("batch-1") == {"ok", "err", "cancel", "lease"}
            await store.drop_progress("batch-1")
            assert await keys("batch-1") == {"lease"}  # the lease lapses by itself
            assert await store.counts("batch-1") == (0, 0)
            assert await store.cancel_requested("batch-1") is None
            assert await keys("batch-2") == {"ok", "err", "cancel"}  # another's kept
        finally:
            await redis.aclose()

    asyncio.run(run())
