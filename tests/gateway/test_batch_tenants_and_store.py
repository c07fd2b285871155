"""The Batch API across tenants and its store, end to end with the official openai SDK:
one tenant's spent budget holds only its own batches; a per-client-IP rate limit does not
count batch lines (they have no client) as one shared address; the listings page as
OpenAI's do; Redis down is a 503 with Retry-After on the files and batches routes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from testkit.batch_api import (
    KEY_A,
    KEY_B,
    KEY_C,
    MODEL,
    batch_client,
    batch_gateway,
    batch_line,
    create,
    file_lines,
    simulated_worker,
    upload,
    wait_for,
)
from testkit.gateway_process import GatewayProcess
from testkit.redis_server import running_redis
from testkit.worker_process import WorkerProcess

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    yield from simulated_worker()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY_A)},
                    {"name": "b", "api_key_sha256": hash_api_key(KEY_B)},
                    {"name": "c", "api_key_sha256": hash_api_key(KEY_C),
                     "daily_token_budget": 1}],
    }  # fmt: skip
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, config_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:  # fmt: skip
    g = batch_gateway(worker, config_path, "--batch-dir", str(tmp_path_factory.mktemp("b")))
    try:
        yield g
    finally:
        g.stop()


def test_a_tenant_whose_budget_is_spent_holds_only_its_own_batches(
    gateway: GatewayProcess,
) -> None:
    """Tenant c's lines are refused until its budget refills at UTC midnight (429 with a
    Retry-After of hours); tenant b's batch, created after c's, still runs at once."""
    spent, other = batch_client(gateway, KEY_C), batch_client(gateway, KEY_B)
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    spent.chat.completions.create(**ask)
    with pytest.raises(openai.RateLimitError) as refused:
        spent.chat.completions.create(**ask)
    # Seconds to the next UTC midnight: hours, but for a run in the day's last minute.
    assert int(refused.value.response.headers["retry-after"]) >= 1
    held = create(spent, [batch_line("c-1"), batch_line("c-2")])
    wait_for(spent, held.id, {"in_progress"})
    time.sleep(1.0)  # the runner tries c's first line and is refused
    runs = create(other, [batch_line("b-1"), batch_line("b-2")])
    done = wait_for(other, runs.id, {"completed", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.request_counts.completed == 2
    still = spent.batches.retrieve(held.id)
    assert still.status == "in_progress" and still.request_counts.completed == 0
    assert spent.batches.cancel(held.id).status == "cancelling"
    cancelled = wait_for(spent, held.id, {"cancelled"})
    assert {e["error"]["code"] for e in file_lines(spent, cancelled.error_file_id)} == {
        "batch_cancelled"
    }


def test_batch_lines_are_not_one_client_under_a_client_ip_limit(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    """With 2 requests a minute per client address, a batch of 5 lines still runs at once:
    its lines come from no client, and keyed as one unknown address every tenant's lines
    would share one bucket (the third line on waited out the minute)."""
    config = {
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY_A)}],
        "rate_limits": {"client_ip": {"requests_per_minute": 2}},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    g = batch_gateway(worker, path, "--batch-dir", str(tmp_path / "batches"))
    try:
        client = batch_client(g)
        batch = create(client, [batch_line(f"ip-{i}") for i in range(5)])
        done = wait_for(client, batch.id, {"completed", "failed"}, timeout_s=30)
        assert done.status == "completed" and done.request_counts.completed == 5
        # The limit still holds for online requests from this address.
        ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        client.chat.completions.create(**ask)
        client.chat.completions.create(**ask)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(**ask)
    finally:
        g.stop()


def test_the_sdk_walks_files_and_batches_page_by_page(
    worker: WorkerProcess, config_path: Path, tmp_path: Path
) -> None:
    g = batch_gateway(worker, config_path, "--batch-dir", str(tmp_path))
    try:
        client = batch_client(g, KEY_B)
        uploaded = [upload(client, [batch_line(f"p-{i}")]) for i in range(5)]
        first = client.files.list(limit=2)
        assert len(first.data) == 2 and first.has_more
        listed = [f.id for f in client.files.list(limit=2)]  # the SDK follows `after`
        assert sorted(listed) == sorted(uploaded) and len(listed) == 5
        assert [f.id for f in client.files.list(order="asc")] == listed[::-1]
        created = [create(client, [batch_line(f"q-{i}")]).id for i in range(3)]
        walked = [b.id for b in client.batches.list(limit=2)]
        assert sorted(walked) == sorted(created) and len(walked) == 3
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.list(limit=101)
        assert refused.value.body["param"] == "limit"  # type: ignore[index]
    finally:
        g.stop()


def test_files_and_batches_answer_503_while_redis_is_down(
    worker: WorkerProcess, config_path: Path
) -> None:
    with running_redis() as redis_server:
        g = batch_gateway(worker, config_path, "--redis-url", redis_server.url)
        try:
            client = batch_client(g)
            file_id = upload(client, [batch_line("r-1")])
            redis_server.stop()
            for call in (client.files.list, lambda: client.files.retrieve(file_id),
                         lambda: client.batches.retrieve("batch_0123")):  # fmt: skip
                with pytest.raises(openai.APIStatusError) as down:
                    call()
                assert down.value.status_code == 503, down.value
                assert down.value.response.headers["retry-after"] == "1"
                assert down.value.body["code"] == "batch_store_unavailable"  # type: ignore[index]
            redis_server.start()  # an empty Redis (no persistence): the routes answer again
            assert client.files.list().data == []
        finally:
            g.stop()
