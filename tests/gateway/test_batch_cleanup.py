"""An ended batch's progress is dropped, end to end with the official openai SDK: once a
batch is completed, cancelled or expired, its lines' results and its cancel request are
gone from the store (Redis keys listed with a real client, files on disk), while
``GET /v1/batches/{id}``, the listing and the output and error files still serve it whole,
counts included. Before, each batch kept its whole output a second time, forever."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import yaml
from testkit.batch_api import (
    KEY_A,
    batch_client,
    batch_gateway,
    batch_line,
    create,
    file_lines,
    simulated_worker,
    wait_for,
)
from testkit.redis_server import RedisServer, running_redis
from testkit.worker_process import WorkerProcess

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PREFIX = "kvflow:batch:default:"  # the Redis store's keys, under the default quota scope


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    yield from simulated_worker()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {"tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY_A)}]}
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


class Store:
    """Where a gateway under test keeps its batches, and what of a batch's is in it."""

    def __init__(self, kind: str, tmp_path: Path, redis_server: RedisServer) -> None:
        self.kind = kind
        self.root = tmp_path
        self.url = redis_server.url

    def flags(self) -> list[str]:
        return ["--batch-dir", str(self.root)] if self.kind == "dir" else ["--redis-url", self.url]

    def progress(self, batch_id: str) -> set[str]:
        """What of the batch's progress is still stored: its results, its cancel."""
        if self.kind == "dir":
            found = {"results": self.root / "results" / f"{batch_id}.jsonl",
                     "cancel": self.root / "cancel" / batch_id}  # fmt: skip
            return {kind for kind, path in found.items() if path.exists()}
        r = redis.Redis.from_url(self.url, decode_responses=True)
        try:
            keys = [str(k) for k in r.keys(f"{PREFIX}*:{batch_id}")]
        finally:
            r.close()
        kinds = {k.removeprefix(PREFIX).split(":")[0] for k in keys}
        assert "batch" in kinds, keys  # its record stays
        named = {"ok": "results", "err": "results", "cancel": "cancel"}
        return {named.get(k, k) for k in kinds - {"batch", "lease"}}  # a lease lapses (30 s)

    def record_kept(self, batch_id: str, file_ids: list[str | None]) -> None:
        """Its record and its output and error files are still stored."""
        if self.kind == "dir":
            assert (self.root / "batches" / f"{batch_id}.json").exists()
            for file_id in filter(None, file_ids):
                assert (self.root / "files" / f"{file_id}.data").exists()
            return
        r = redis.Redis.from_url(self.url)
        try:
            assert r.exists(PREFIX + "batch:" + batch_id)
            for file_id in filter(None, file_ids):
                assert r.exists(PREFIX + "content:" + file_id)
        finally:
            r.close()


def _dropped(store: Store, batch_id: str, timeout_s: float = 10) -> None:
    """Its progress is dropped right after its last record is stored: a GET may see the
    record a moment before."""
    deadline = time.monotonic() + timeout_s
    while (left := store.progress(batch_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"batch {batch_id} ended, and still has its {sorted(left)} stored"


def _wait_done_lines(client: openai.OpenAI, batch_id: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while client.batches.retrieve(batch_id).request_counts.completed < n:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _counts(batch: object) -> tuple[int, int, int]:
    counts = batch.request_counts  # type: ignore[attr-defined]
    return counts.total, counts.completed, counts.failed


@pytest.fixture(params=["dir", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer) -> Store:
    return Store(request.param, tmp_path, redis_server)


def test_a_completed_and_a_cancelled_batch_drop_their_progress(
    store: Store, worker: WorkerProcess, config_path: Path
) -> None:
    g = batch_gateway(worker, config_path, *store.flags(), extra=("--batch-max-in-flight", "1"))
    try:
        client = batch_client(g)
        lines = [batch_line(f"ok-{i}") for i in range(4)] + [batch_line("bad", max_tokens=-1)]
        batch = create(client, lines)
        done = wait_for(client, batch.id, {"completed", "failed", "expired"})
        assert done.status == "completed", done
        _dropped(store, batch.id)
        store.record_kept(batch.id, [done.output_file_id, done.error_file_id])
        again = client.batches.retrieve(batch.id)
        assert again.status == "completed" and _counts(again) == (5, 4, 1)
        assert again.output_file_id == done.output_file_id
        listed = {b.id: b for b in client.batches.list()}
        assert _counts(listed[batch.id]) == (5, 4, 1)
        outputs = file_lines(client, again.output_file_id)
        assert [o["custom_id"] for o in outputs] == [f"ok-{i}" for i in range(4)]
        (error,) = file_lines(client, again.error_file_id)
        assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400

        running = create(client, [batch_line(f"c-{i}", max_tokens=10) for i in range(40)])
        _wait_done_lines(client, running.id, 2)
        assert store.progress(running.id) == {"results"}
        assert client.batches.cancel(running.id).status == "cancelling"
        assert store.progress(running.id) == {"results", "cancel"}
        cancelled = wait_for(client, running.id, {"cancelled"})
        _dropped(store, running.id)
        store.record_kept(running.id, [cancelled.output_file_id, cancelled.error_file_id])
        shown = client.batches.retrieve(running.id)
        outputs = file_lines(client, shown.output_file_id)
        errors = file_lines(client, shown.error_file_id)
        assert shown.status == "cancelled" and 2 <= len(outputs) < 40
        assert _counts(shown) == (40, len(outputs), 0)
        assert len(outputs) + len(errors) == 40
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.APIStatusError) as again_cancel:
            client.batches.cancel(running.id)
        assert again_cancel.value.status_code == 409
        assert not store.progress(running.id)  # a refused cancel stores none
    finally:
        g.stop()


def test_an_expired_batch_drops_its_progress(
    store: Store, worker: WorkerProcess, config_path: Path
) -> None:
    g = batch_gateway(worker, config_path, *store.flags(),
                      extra=("--batch-max-in-flight", "1",
                             "--batch-completion-window-s", "2"))  # fmt: skip
    try:
        client = batch_client(g)
        batch = create(client, [batch_line(f"e-{i}", max_tokens=10) for i in range(60)])
        done = wait_for(client, batch.id, {"expired", "completed"})
        assert done.status == "expired", done
        _dropped(store, batch.id)
        store.record_kept(batch.id, [done.output_file_id, done.error_file_id])
        shown = client.batches.retrieve(batch.id)
        outputs = file_lines(client, shown.output_file_id)
        errors = file_lines(client, shown.error_file_id)
        assert outputs, "lines done within the window are in the output file"
        assert _counts(shown) == (60, len(outputs), 0)
        assert len(outputs) + len(errors) == 60
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    finally:
        g.stop()
