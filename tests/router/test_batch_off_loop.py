"""A batch's heavy work runs off the event loop, which serves the online requests
meanwhile: parsing its input (up to --batch-max-file-bytes), reading its results from the
directory store, building and serialising its output and error files. On the real
directory store; the runner answers each line itself (as test_batch_progress_drop.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from fastapi import FastAPI

from kvflow.router.api.gateway import Gateway
from kvflow.router.batch import jsonl, runner, store
from kvflow.router.batch.config import BatchConfig
from kvflow.router.batch.records import FILE_PURPOSE, BatchRecord, FileRecord, Status
from kvflow.router.batch.runner import BatchRunner
from kvflow.router.batch.store import DirBatchStore

CHAT = "/v1/chat/completions"
F = TypeVar("F", bound=Callable[..., Any])


class _Answering(BatchRunner):
    def _pool_is_busy(self, record: BatchRecord, line: Any) -> bool:
        return False

    async def _answer(self, record: BatchRecord, line: Any) -> tuple[int, str, dict[str, Any]]:
        return 200, f"req-{line.index}", {"n": line.index}


def test_parsing_reading_and_building_files_never_run_on_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, list[bool]] = {}
    lock = threading.Lock()

    def watched(name: str, real: F) -> F:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            with lock:
                calls.setdefault(name, []).append(on_loop)
            return real(*args, **kwargs)

        return cast(F, call)

    monkeypatch.setattr(runner, "parse_input", watched("parse_input", jsonl.parse_input))
    monkeypatch.setattr(runner, "result_files", watched("result_files", jsonl.result_files))
    monkeypatch.setattr(runner, "dump_lines", watched("dump_lines", runner.dump_lines))
    monkeypatch.setattr(store, "_read_results", watched("_read_results", store._read_results))

    async def run() -> None:
        dir_store = DirBatchStore(tmp_path)
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT,
                  "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
                 for i in range(5)]  # fmt: skip
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        await dir_store.put_file(FileRecord("file-in", "a", "in.jsonl", FILE_PURPOSE,
                                            len(content), 1), content)  # fmt: skip
        await dir_store.put_batch(BatchRecord("batch-1", "a", CHAT, "file-in", "24h", 1, 2**40))
        batches = _Answering(FastAPI(), cast(Gateway, None), dir_store,
                             BatchConfig(poll_interval_s=0.01, busy_backoff_s=0.01))  # fmt: skip
        for _ in range(200):
            await batches.step()
            await asyncio.sleep(0.01)
            record = await dir_store.get_batch("batch-1")
            if record is not None and record.status is Status.COMPLETED:
                break
        assert record is not None and record.status is Status.COMPLETED, record

    asyncio.run(run())
    assert set(calls) == {"parse_input", "result_files", "dump_lines", "_read_results"}, calls
    assert not any(on_loop for seen in calls.values() for on_loop in seen), calls
