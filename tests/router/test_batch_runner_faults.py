"""The batch runner under a pass that keeps failing: a bug (the same input failing the
same code every pass) fails the batch after MAX_FAILED_PASSES passes in a row, with an
``internal_error``, instead of leaving it unfinished forever; a store outage is waited out
however long it lasts, and the batch goes on once the store is back. On the real
directory store; the fault is injected into the runner's input parser and the store's
reads."""

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
