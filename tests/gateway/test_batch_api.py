"""The Batch API end to end with the official openai SDK: real router processes in front of a
simulated worker process, a directory store and a real redis-server. Upload, run, download;
a bad line lands in the error file; tenants see only their own; cancel; expiry; a router
killed mid-batch resumes without running done lines again; batch lines cost the discount.
Across tenants and the store: test_batch_tenants_and_store.py."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testkit.batch_api import (
    KEY_A,
    KEY_B,
    MODEL,
    batch_client,
    batch_gateway,
    batch_line,
    file_lines,
    simulated_worker,
    upload,
    wait_for,
)
from testkit.gateway_process import GatewayProcess
from testkit.redis_server import RedisServer, running_redis
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 1 USD per completion token: a line's spend shows the discount exactly.
PRICES = {"output_usd_per_million_tokens": 1_000_000}
USD = 10**12


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    yield from simulated_worker()


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY_A)},
                    {"name": "b", "api_key_sha256": hash_api_key(KEY_B)}],
        "prices": {MODEL: PRICES},
    }  # fmt: skip
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, config_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:  # fmt: skip
    g = batch_gateway(worker, config_path, "--batch-dir", str(tmp_path_factory.mktemp("batches")),
                 extra=("--batch-max-file-bytes", "4096"))  # fmt: skip
    try:
        yield g
    finally:
        g.stop()


def test_batch_runs_to_completed_with_a_bad_line_in_the_error_file(
    gateway: GatewayProcess,
) -> None:
    client = batch_client(gateway)
    lines = [batch_line(f"ok-{i}") for i in range(5)] + [batch_line("bad", max_tokens=-1)]
    file_id = upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "t1"})  # fmt: skip
    assert batch.status in ("validating", "in_progress")
    done = wait_for(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 5, 1)  # fmt: skip
    assert done.metadata == {"job": "t1"} and done.completed_at is not None
    outputs = file_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == [f"ok-{i}" for i in range(5)]
    for o in outputs:
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["usage"]["completion_tokens"] == 2
    (error,) = file_lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["response"]["body"]["error"]["message"]
    assert batch.id in [b.id for b in client.batches.list()]
    assert file_id in [f.id for f in client.files.list()]


def test_a_batch_of_responses_api_lines_answers_each_with_a_response(
    gateway: GatewayProcess,
) -> None:
    client = batch_client(gateway)
    lines = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": MODEL, "input": f"r-{i}", "instructions": "Be brief.",
                       "max_output_tokens": 2}} for i in range(3)]  # fmt: skip
    lines.append(
        {
            "custom_id": "stored",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL, "input": "x", "previous_response_id": "resp_1"},
        }
    )
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/responses",
                                  completion_window="24h")  # fmt: skip
    done = wait_for(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed", done
    outputs = file_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["r-0", "r-1", "r-2"]
    for o in outputs:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "response"
        assert body["output"][0]["type"] == "message" and body["instructions"] == "Be brief."
        assert 1 <= body["usage"]["output_tokens"] <= 2
    (error,) = file_lines(client, done.error_file_id)
    assert error["custom_id"] == "stored" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["param"] == "previous_response_id"


def test_batch_lines_are_charged_at_the_discount(gateway: GatewayProcess) -> None:
    client = batch_client(gateway, KEY_B)

    def spend() -> int:
        usage = httpx.get(f"{gateway.base_url}/usage",
                          headers={"authorization": f"Bearer {KEY_B}"}).json()  # fmt: skip
        return int(usage["spend_pusd"])

    before = spend()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2, extra_body={"ignore_eos": True})  # fmt: skip
    online = spend() - before
    assert online == 2 * USD
    file_id = upload(client, [batch_line("one"), batch_line("two")])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    assert wait_for(client, batch.id, {"completed"}).status == "completed"
    # Two lines of 2 tokens at half price: what one online request cost.
    assert spend() - before - online == 2 * USD


def test_a_tenant_sees_only_its_own_files_and_batches(gateway: GatewayProcess) -> None:
    a, b = batch_client(gateway, KEY_A), batch_client(gateway, KEY_B)
    file_id = upload(a, [batch_line("mine")])
    batch = a.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    for call in (lambda: b.files.retrieve(file_id), lambda: b.files.content(file_id),
                 lambda: b.files.delete(file_id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=file_id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in b.files.list()]
    auth = {"authorization": f"Bearer {KEY_A}"}
    for odd in (".hidden", "file:x", "x" * 200):  # ids never made here: no such thing
        for kind in ("files", "batches"):
            answer = httpx.get(f"{gateway.base_url}/{kind}/{odd}", headers=auth, timeout=10)
            assert answer.status_code == 404, answer.text
    assert batch.id not in [x.id for x in b.batches.list()]
    with pytest.raises(openai.AuthenticationError):
        batch_client(gateway, "sk-nobody-0123456789").files.list()


def test_bad_requests_get_openai_errors(gateway: GatewayProcess) -> None:
    client = batch_client(gateway)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("f.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    file_id = upload(client, [batch_line("x")])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )  # type: ignore[arg-type]
    # A file that is not a batch of this endpoint fails the batch, naming the line.
    wrong = upload(client, [batch_line("a"), {**batch_line("b"), "url": "/v1/completions"}])
    batch = client.batches.create(input_file_id=wrong, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    failed = wait_for(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    assert failed.errors is not None and failed.errors.data
    assert failed.errors.data[0].line == 2
    # A lone surrogate escape (json.dumps writes one for "\ud800") failed every pass of the
    # runner, and the batch never ended: now the line fails validation.
    lone = upload(client, [batch_line("a"), batch_line("\ud800")])
    batch = client.batches.create(input_file_id=lone, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    failed = wait_for(client, batch.id, {"failed", "completed"}, timeout_s=30)
    assert failed.status == "failed" and failed.errors is not None
    (problem,) = failed.errors.data
    assert problem.line == 2 and problem.code == "invalid_json_line"
    assert "surrogate" in (problem.message or "")
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)


def test_cancel_stops_a_batch_and_lists_the_rest_as_cancelled(
    worker: WorkerProcess, config_path: Path, tmp_path: Path
) -> None:
    g = batch_gateway(worker, config_path, "--batch-dir", str(tmp_path),
                 extra=("--batch-max-in-flight", "1"))  # fmt: skip
    try:
        client = batch_client(g)
        file_id = upload(client, [batch_line(f"c-{i}", max_tokens=10) for i in range(40)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        wait_for(client, batch.id, {"in_progress"})
        with pytest.raises(openai.APIStatusError) as in_use:
            client.files.delete(file_id)  # a restart would read its lines again
        assert in_use.value.status_code == 409
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = wait_for(client, batch.id, {"cancelled"})
        assert done.cancelled_at is not None
        outputs, errors = (
            file_lines(client, done.output_file_id),
            file_lines(client, done.error_file_id),
        )
        assert len(outputs) + len(errors) == 40 and len(outputs) < 40
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        with pytest.raises(openai.APIStatusError) as again:
            client.batches.cancel(batch.id)
        assert again.value.status_code == 409
        assert client.files.delete(file_id).deleted  # the batch is over
    finally:
        g.stop()


def test_a_batch_past_its_window_expires_with_done_lines_kept(
    worker: WorkerProcess, config_path: Path, tmp_path: Path
) -> None:
    g = batch_gateway(
        worker,
        config_path,
        "--batch-dir",
        str(tmp_path),
        extra=("--batch-max-in-flight", "1", "--batch-completion-window-s", "2"),
    )
    try:
        client = batch_client(g)
        file_id = upload(client, [batch_line(f"e-{i}", max_tokens=10) for i in range(60)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        done = wait_for(client, batch.id, {"expired", "completed"})
        assert done.status == "expired" and done.expired_at is not None
        outputs, errors = (
            file_lines(client, done.output_file_id),
            file_lines(client, done.error_file_id),
        )
        assert outputs, "lines done within the window are in the output file"
        assert len(outputs) + len(errors) == 60
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    finally:
        g.stop()


def _stored_results(store: str, where: str, batch_id: str) -> int:
    if store == "dir":
        path = Path(where) / "results" / f"{batch_id}.jsonl"
        return len({json.loads(s)["i"] for s in path.read_text().splitlines()})
    import redis

    r = redis.Redis.from_url(where)
    prefix = "kvflow:batch:default:"
    return int(r.hlen(prefix + "ok:" + batch_id) + r.hlen(prefix + "err:" + batch_id))


@pytest.mark.parametrize("store", ["dir", "redis"])
def test_a_restarted_router_resumes_without_rerunning_donefile_lines(
    store: str, worker: WorkerProcess, config_path: Path, tmp_path: Path,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    where = str(tmp_path) if store == "dir" else redis_server.url
    flag = ["--batch-dir", where] if store == "dir" else ["--redis-url", where]
    extra = ("--batch-max-in-flight", "1")
    total = 30
    first = batch_gateway(worker, config_path, *flag, extra=extra)
    try:
        client = batch_client(first)
        file_id = upload(client, [batch_line(f"r-{i}", max_tokens=5) for i in range(total)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 30
        while client.batches.retrieve(batch.id).request_counts.completed < 5:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.stop(signal.SIGKILL)  # a crash: nothing flushed on the way out
    done_before = _stored_results(store, where, batch.id)
    assert 5 <= done_before < total
    second = batch_gateway(worker, config_path, *flag, extra=extra)
    try:
        client = batch_client(second)
        done = wait_for(client, batch.id, {"completed"})
        outputs = file_lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"r-{i}" for i in range(total))
        assert done.request_counts is not None and done.request_counts.completed == total
        ran_here = sample(f"{second.url}/metrics", "kvflow_router_tenant_requests_total",
                          tenant="a")  # fmt: skip
        assert ran_here == total - done_before
    finally:
        second.stop()
