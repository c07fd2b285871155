"""The batch runner under a pass that keeps failing: a bug (the same input failing the
same code every pass) fails the batch after MAX_FAILED_PASSES passes in a row, with an
``internal_error``, instead of leaving it unfinished forever; a store outage is waited out
however long it lasts, and the batch goes on once the store is back; a result the store
refuses is written again, not lost; a batch whose input cannot be read again on resume
fails with the reason; batches run oldest first, and one whose record cannot be read holds
no other. On the real directory store; the fault is injected into the runner's input
parser and the store's reads and writes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from redis.exceptions import ConnectionError as RedisConnectionError

from kvflow.router.api.gateway import Gateway
from kvflow.router.batch import runner as runner_module
from kvflow.router.batch.config import BatchConfig
from kvflow.router.batch.jsonl import parse_input
from kvflow.router.batch.records import FILE_PURPOSE, BatchRecord, FileRecord, Status
from kvflow.router.batch.runner import MAX_FAILED_PASSES, BatchRunner
from kvflow.router.batch.store import DirBatchStore

CHAT = "/v1/chat/completions"
LINE = {"custom_id": "a", "method": "POST", "url": CHAT,
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip


class FlakyStore(DirBatchStore):
    """The directory store whose content reads fail, as Redis down does, ``outage`` times."""

    def __init__(self, root: Path, outage: int) -> None:
        super().__init__(root)
        self.outage = outage

    async def get_content(self, file_id: str) -> bytes | None:
        if self.outage > 0:
            self.outage -= 1
            raise RedisConnectionError("Connection refused")
        return await super().get_content(file_id)


async def _batch(store: DirBatchStore, status: Status = Status.VALIDATING) -> BatchRecord:
    content = (json.dumps(LINE) + "\n").encode()
    await store.put_file(FileRecord("file-in", "a", "in.jsonl", FILE_PURPOSE, len(content), 1),
                         content)  # fmt: skip
    record = BatchRecord("batch-1", "a", CHAT, "file-in", "24h", 1, 2**40)
    if status is Status.IN_PROGRESS:
        record = record.moved(Status.IN_PROGRESS, 2, total=1)
    await store.put_batch(record)
    return record


def _runner(store: DirBatchStore) -> BatchRunner:
    # Validation and the failing passes below touch neither the app nor the gateway.
    return BatchRunner(FastAPI(), cast(Gateway, None), store, BatchConfig())


def _broken_parser(failures: list[int]) -> Any:
    """parse_input that raises for as many calls as ``failures[0]``, then parses."""

    def parse(*args: Any, **kwargs: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("a bug in the runner")
        return parse_input(*args, **kwargs)

    return parse


@pytest.mark.parametrize("status", [Status.VALIDATING, Status.IN_PROGRESS])
def test_a_pass_that_always_fails_fails_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: Status
) -> None:
    monkeypatch.setattr(runner_module, "parse_input", _broken_parser([10**6]))

    async def run() -> None:
        store = DirBatchStore(tmp_path)
        await _batch(store, status)
        runner = _runner(store)
        for _ in range(MAX_FAILED_PASSES - 1):
            await runner.step()
        assert (await store.get_batch("batch-1")).status is status  # type: ignore[union-attr]
        await runner.step()
        failed = await store.get_batch("batch-1")
        assert failed is not None and failed.status is Status.FAILED
        assert [e["code"] for e in failed.errors] == ["internal_error"]
        assert "failed_at" in failed.stamps
        assert await store.active_batch_ids() == []  # no pass runs it again

    asyncio.run(run())


def test_fewer_failed_passes_in_a_row_than_the_limit_do_not_fail_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "parse_input", _broken_parser([MAX_FAILED_PASSES - 1]))

    async def run() -> None:
        store = DirBatchStore(tmp_path)
        await _batch(store)
        runner = _runner(store)
        for _ in range(MAX_FAILED_PASSES):
            await runner.step()
        record = await store.get_batch("batch-1")
        assert record is not None and record.status is Status.IN_PROGRESS

    asyncio.run(run())


def test_a_store_outage_is_waited_out_however_long(tmp_path: Path) -> None:
    async def run() -> None:
        store = FlakyStore(tmp_path, outage=3 * MAX_FAILED_PASSES)
        await _batch(store)
        runner = _runner(store)
        for _ in range(3 * MAX_FAILED_PASSES):
            await runner.step()
            record = await store.get_batch("batch-1")
            assert record is not None and record.status is Status.VALIDATING
        await runner.step()  # the store is back
        record = await store.get_batch("batch-1")
        assert record is not None and record.status is Status.IN_PROGRESS and record.total == 1

    asyncio.run(run())


class _Answering(BatchRunner):
    """The runner with each line answered 200 at once: these tests are of its bookkeeping
    (the gateway's answer path is tests/gateway/test_batch_api.py's)."""

    def _pool_is_busy(self, record: BatchRecord, line: Any) -> bool:
        return False

    async def _answer(self, record: BatchRecord, line: Any) -> tuple[int, str, dict[str, Any]]:
        return 200, f"req-{line.index}", {"ok": True}


class ResultBlips(DirBatchStore):
    """The directory store whose result writes fail, as Redis down does, ``outage`` times."""

    def __init__(self, root: Path, outage: int) -> None:
        super().__init__(root)
        self.outage = outage

    async def add_result(self, batch_id: str, index: int, ok: bool, line: str) -> None:
        if self.outage > 0:
            self.outage -= 1
            raise RedisConnectionError("Connection refused")
        await super().add_result(batch_id, index, ok, line)


def _answering(store: DirBatchStore) -> _Answering:
    config = BatchConfig(poll_interval_s=0.01, busy_backoff_s=0.01)
    return _Answering(FastAPI(), cast(Gateway, None), store, config)


async def _passes(runner: BatchRunner, store: DirBatchStore, n: int, batch_id: str) -> Status:
    for _ in range(n):
        await runner.step()
        await asyncio.sleep(0.02)
        record = await store.get_batch(batch_id)
        assert record is not None
        if record.status.is_terminal:
            return record.status
    return record.status


async def _final_counts(store: DirBatchStore, batch_id: str) -> tuple[int, int, int]:
    """An ended batch's counts, its record's: its lines' results are dropped by then."""
    record = await store.get_batch(batch_id)
    assert record is not None and record.final_counts is not None
    assert await store.results(batch_id) == {}
    counts = record.final_counts
    return counts.total, counts.completed, counts.failed


def test_a_result_the_store_refuses_is_written_again_not_lost(tmp_path: Path) -> None:
    """Before: the line's task died, the batch had nothing pending or in flight and ended
    ``expired`` with its window all but unused and that line listed as never run."""

    async def run() -> None:
        store = ResultBlips(tmp_path, outage=3)
        await _batch(store)
        status = await _passes(_answering(store), store, 50, "batch-1")
        assert status is Status.COMPLETED
        assert await _final_counts(store, "batch-1") == (1, 1, 0)

    asyncio.run(run())


def test_a_batch_whose_input_is_gone_on_resume_fails_and_says_why(tmp_path: Path) -> None:
    """A router that picks up a running batch (a restart, another replica's lease) and
    cannot read its input again fails it; before, it completed it with no lines."""

    async def run() -> None:
        store = DirBatchStore(tmp_path)
        await _batch(store, Status.IN_PROGRESS)
        await store.delete_file("file-in")
        status = await _passes(_answering(store), store, 3, "batch-1")
        failed = await store.get_batch("batch-1")
        assert status is Status.FAILED and failed is not None
        assert [e["code"] for e in failed.errors] == ["file_not_found"]

    asyncio.run(run())


def test_a_resumed_batch_is_not_held_to_a_lower_line_limit(tmp_path: Path) -> None:
    async def run() -> None:
        store = DirBatchStore(tmp_path)
        content = "".join(json.dumps({**LINE, "custom_id": f"l{i}"}) + "\n" for i in range(3))
        await store.put_file(FileRecord("file-in", "a", "in.jsonl", FILE_PURPOSE,
                                        len(content), 1), content.encode())  # fmt: skip
        record = BatchRecord("batch-1", "a", CHAT, "file-in", "24h", 1, 2**40)
        await store.put_batch(record.moved(Status.IN_PROGRESS, 2, total=3))
        config = BatchConfig(poll_interval_s=0.01, busy_backoff_s=0.01, max_lines=2)
        runner = _Answering(FastAPI(), cast(Gateway, None), store, config)
        assert await _passes(runner, store, 50, "batch-1") is Status.COMPLETED
        assert await _final_counts(store, "batch-1") == (3, 3, 0)

    asyncio.run(run())


class OneUnreadable(DirBatchStore):
    """A record this version cannot read (a newer router's, during a rolling upgrade)."""

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        if batch_id == "batch-0":
            raise TypeError("BatchRecord.__init__() got an unexpected keyword argument 'x'")
        return await super().get_batch(batch_id)


def test_batches_run_oldest_first_and_an_unreadable_one_holds_no_other(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        store = OneUnreadable(tmp_path)
        content = (json.dumps(LINE) + "\n").encode()
        await store.put_file(FileRecord("file-in", "a", "in.jsonl", FILE_PURPOSE,
                                        len(content), 1), content)  # fmt: skip
        # Ids sort the other way round from creation: "batch-z" is the oldest.
        for batch_id, created_s in (("batch-0", 0), ("batch-a", 20), ("batch-z", 10)):
            await store.put_batch(BatchRecord(batch_id, "a", CHAT, "file-in", "24h",
                                              created_s, 2**40))  # fmt: skip
        runner = _answering(store)
        order: list[str] = []
        advance = runner._advance

        async def noting(record: BatchRecord) -> None:
            order.append(record.id)
            await advance(record)

        runner._advance = noting  # type: ignore[method-assign]
        for _ in range(5 * MAX_FAILED_PASSES):
            await runner.step()
            await asyncio.sleep(0.01)
        assert order[:2] == ["batch-z", "batch-a"]
        for batch_id in ("batch-a", "batch-z"):
            done = await store.get_batch(batch_id)
            assert done is not None and done.status is Status.COMPLETED

    asyncio.run(run())


class LeaseLost(DirBatchStore):
    """A shared store's lease that this replica holds for ``held`` passes, then loses."""

    def __init__(self, root: Path, held: int) -> None:
        super().__init__(root)
        self.held = held

    async def claim(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        self.held -= 1
        return self.held >= 0


class _Slow(_Answering):
    async def _answer(self, record: BatchRecord, line: Any) -> tuple[int, str, dict[str, Any]]:
        await asyncio.sleep(60)
        return await super()._answer(record, line)


def test_a_replica_that_loses_a_batchs_lease_lets_go_of_it(tmp_path: Path) -> None:
    async def run() -> None:
        store = LeaseLost(tmp_path, held=2)
        await _batch(store)
        runner = _Slow(FastAPI(), cast(Gateway, None), store,
                       BatchConfig(poll_interval_s=0.01, busy_backoff_s=0.01))  # fmt: skip
        await runner.step()  # validated
        await runner.step()  # its line started
        assert runner.num_in_flight() == 1
        await runner.step()  # the lease is another's now
        assert runner.num_in_flight() == 0
        await asyncio.sleep(0)
        record = await store.get_batch("batch-1")
        assert record is not None and record.status is Status.IN_PROGRESS
        assert await store.results("batch-1") == {}

    asyncio.run(run())
