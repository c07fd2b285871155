"""The Batch API end to end with the official openai SDK: real router processes in front of a
simulated worker process, a directory store and a real redis-server. Upload, run, download;
a bad line lands in the error file; tenants see only their own; cancel; expiry; a router
killed mid-batch resumes without running done lines again; batch lines cost the discount;
one tenant's spent budget holds only its own batches, and a per-client-IP rate limit does
not count batch lines (they have no client) as one shared address; Redis down is a 503
with Retry-After on the files and batches routes."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import RedisServer, running_redis
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
KEY_A = "sk-batch-tenant-a-0123"
KEY_B = "sk-batch-tenant-b-0123"
KEY_C = "sk-batch-tenant-c-0123"  # a daily budget of 1 token: spent by its first request
# 1 USD per completion token: a line's spend shows the discount exactly.
PRICES = {"output_usd_per_million_tokens": 1_000_000}
USD = 10**12


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--simulate", "--served-model-name", MODEL,
                       "--sim-base-step-ms", "20"], timeout_s=120)  # fmt: skip
    try:
        yield w
    finally:
        w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEY_A)},
                    {"name": "b", "api_key_sha256": hash_api_key(KEY_B)},
                    {"name": "c", "api_key_sha256": hash_api_key(KEY_C),
                     "daily_token_budget": 1}],
        "prices": {MODEL: PRICES},
    }  # fmt: skip
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def _gateway(worker: WorkerProcess, config: Path, *store: str, extra: tuple[str, ...] = ()
             ) -> GatewayProcess:  # fmt: skip
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--config", str(config), *store, *extra])  # fmt: skip
    g.wait_ready()
    return g


def _client(g: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=key, max_retries=0, timeout=30)


def _line(custom_id: str, *, max_tokens: int = 2, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": custom_id}],
                     "max_tokens": max_tokens, "ignore_eos": True, **body}}  # fmt: skip


def _upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def _create(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    file_id = _upload(client, lines)
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _wait(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60
          ) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(s) for s in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, config_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:  # fmt: skip
    g = _gateway(worker, config_path, "--batch-dir", str(tmp_path_factory.mktemp("batches")),
                 extra=("--batch-max-file-bytes", "4096"))  # fmt: skip
    try:
        yield g
    finally:
        g.stop()


def test_batch_runs_to_completed_with_a_bad_line_in_the_error_file(
    gateway: GatewayProcess,
) -> None:
    client = _client(gateway)
    lines = [_line(f"ok-{i}") for i in range(5)] + [_line("bad", max_tokens=-1)]
    file_id = _upload(client, lines)
    assert client.files.retrieve(file_id).purpose == "batch"
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "t1"})  # fmt: skip
    assert batch.status in ("validating", "in_progress")
    done = _wait(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (6, 5, 1)  # fmt: skip
    assert done.metadata == {"job": "t1"} and done.completed_at is not None
    outputs = _lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == [f"ok-{i}" for i in range(5)]
    for o in outputs:
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["usage"]["completion_tokens"] == 2
    (error,) = _lines(client, done.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "max_tokens" in error["response"]["body"]["error"]["message"]
    assert batch.id in [b.id for b in client.batches.list()]
    assert file_id in [f.id for f in client.files.list()]


def test_a_batch_of_responses_api_lines_answers_each_with_a_response(
    gateway: GatewayProcess,
) -> None:
    client = _client(gateway)
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
    batch = client.batches.create(input_file_id=_upload(client, lines), endpoint="/v1/responses",
                                  completion_window="24h")  # fmt: skip
    done = _wait(client, batch.id, {"completed", "failed", "expired"})
    assert done.status == "completed", done
    outputs = _lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == ["r-0", "r-1", "r-2"]
    for o in outputs:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "response"
        assert body["output"][0]["type"] == "message" and body["instructions"] == "Be brief."
        assert 1 <= body["usage"]["output_tokens"] <= 2
    (error,) = _lines(client, done.error_file_id)
    assert error["custom_id"] == "stored" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["param"] == "previous_response_id"


def test_batch_lines_are_charged_at_the_discount(gateway: GatewayProcess) -> None:
    client = _client(gateway, KEY_B)

    def spend() -> int:
        usage = httpx.get(f"{gateway.base_url}/usage",
                          headers={"authorization": f"Bearer {KEY_B}"}).json()  # fmt: skip
        return int(usage["spend_pusd"])

    before = spend()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2, extra_body={"ignore_eos": True})  # fmt: skip
    online = spend() - before
    assert online == 2 * USD
    file_id = _upload(client, [_line("one"), _line("two")])
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    assert _wait(client, batch.id, {"completed"}).status == "completed"
    # Two lines of 2 tokens at half price: what one online request cost.
    assert spend() - before - online == 2 * USD


def test_a_tenant_sees_only_its_own_files_and_batches(gateway: GatewayProcess) -> None:
    a, b = _client(gateway, KEY_A), _client(gateway, KEY_B)
    file_id = _upload(a, [_line("mine")])
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
        _client(gateway, "sk-nobody-0123456789").files.list()


def test_bad_requests_get_openai_errors(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("f.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    file_id = _upload(client, [_line("x")])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )  # type: ignore[arg-type]
    # A file that is not a batch of this endpoint fails the batch, naming the line.
    wrong = _upload(client, [_line("a"), {**_line("b"), "url": "/v1/completions"}])
    batch = client.batches.create(input_file_id=wrong, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    failed = _wait(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed"
    assert failed.errors is not None and failed.errors.data
    assert failed.errors.data[0].line == 2
    # A lone surrogate escape (json.dumps writes one for "\ud800") failed every pass of the
    # runner, and the batch never ended: now the line fails validation.
    lone = _upload(client, [_line("a"), _line("\ud800")])
    batch = client.batches.create(input_file_id=lone, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    failed = _wait(client, batch.id, {"failed", "completed"}, timeout_s=30)
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
    g = _gateway(worker, config_path, "--batch-dir", str(tmp_path),
                 extra=("--batch-max-in-flight", "1"))  # fmt: skip
    try:
        client = _client(g)
        file_id = _upload(client, [_line(f"c-{i}", max_tokens=10) for i in range(40)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        _wait(client, batch.id, {"in_progress"})
        with pytest.raises(openai.APIStatusError) as in_use:
            client.files.delete(file_id)  # a restart would read its lines again
        assert in_use.value.status_code == 409
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = _wait(client, batch.id, {"cancelled"})
        assert done.cancelled_at is not None
        outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
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
    g = _gateway(
        worker,
        config_path,
        "--batch-dir",
        str(tmp_path),
        extra=("--batch-max-in-flight", "1", "--batch-completion-window-s", "2"),
    )
    try:
        client = _client(g)
        file_id = _upload(client, [_line(f"e-{i}", max_tokens=10) for i in range(60)])
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        done = _wait(client, batch.id, {"expired", "completed"})
        assert done.status == "expired" and done.expired_at is not None
        outputs, errors = _lines(client, done.output_file_id), _lines(client, done.error_file_id)
        assert outputs, "lines done within the window are in the output file"
        assert len(outputs) + len(errors) == 60
        assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    finally:
        g.stop()


def test_a_tenant_whose_budget_is_spent_holds_only_its_own_batches(
    gateway: GatewayProcess,
) -> None:
    """Tenant c's lines are refused until its budget refills at UTC midnight (429 with a
    Retry-After of hours); tenant b's batch, created after c's, still runs at once."""
    spent, other = _client(gateway, KEY_C), _client(gateway, KEY_B)
    ask = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    spent.chat.completions.create(**ask)
    with pytest.raises(openai.RateLimitError) as refused:
        spent.chat.completions.create(**ask)
    # Seconds to the next UTC midnight: hours, but for a run in the day's last minute.
    assert int(refused.value.response.headers["retry-after"]) >= 1
    held = _create(spent, [_line("c-1"), _line("c-2")])
    _wait(spent, held.id, {"in_progress"})
    time.sleep(1.0)  # the runner tries c's first line and is refused
    runs = _create(other, [_line("b-1"), _line("b-2")])
    done = _wait(other, runs.id, {"completed", "failed"}, timeout_s=30)
    assert done.status == "completed" and done.request_counts.completed == 2
    still = spent.batches.retrieve(held.id)
    assert still.status == "in_progress" and still.request_counts.completed == 0
    assert spent.batches.cancel(held.id).status == "cancelling"
    cancelled = _wait(spent, held.id, {"cancelled"})
    assert {e["error"]["code"] for e in _lines(spent, cancelled.error_file_id)} == {
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
    g = _gateway(worker, path, "--batch-dir", str(tmp_path / "batches"))
    try:
        client = _client(g)
        batch = _create(client, [_line(f"ip-{i}") for i in range(5)])
        done = _wait(client, batch.id, {"completed", "failed"}, timeout_s=30)
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
    g = _gateway(worker, config_path, "--batch-dir", str(tmp_path))
    try:
        client = _client(g, KEY_B)
        uploaded = [_upload(client, [_line(f"p-{i}")]) for i in range(5)]
        first = client.files.list(limit=2)
        assert len(first.data) == 2 and first.has_more
        listed = [f.id for f in client.files.list(limit=2)]  # the SDK follows `after`
        assert sorted(listed) == sorted(uploaded) and len(listed) == 5
        assert [f.id for f in client.files.list(order="asc")] == listed[::-1]
        created = [_create(client, [_line(f"q-{i}")]).id for i in range(3)]
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
        g = _gateway(worker, config_path, "--redis-url", redis_server.url)
        try:
            client = _client(g)
            file_id = _upload(client, [_line("r-1")])
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


def _stored_results(store: str, where: str, batch_id: str) -> int:
    if store == "dir":
        path = Path(where) / "results" / f"{batch_id}.jsonl"
        return len({json.loads(s)["i"] for s in path.read_text().splitlines()})
    import redis

    r = redis.Redis.from_url(where)
    prefix = "kvflow:batch:default:"
    return int(r.hlen(prefix + "ok:" + batch_id) + r.hlen(prefix + "err:" + batch_id))


@pytest.mark.parametrize("store", ["dir", "redis"])
def test_a_restarted_router_resumes_without_rerunning_done_lines(
    store: str, worker: WorkerProcess, config_path: Path, tmp_path: Path,
    redis_server: RedisServer,
) -> None:  # fmt: skip
    where = str(tmp_path) if store == "dir" else redis_server.url
    flag = ["--batch-dir", where] if store == "dir" else ["--redis-url", where]
    extra = ("--batch-max-in-flight", "1")
    total = 30
    first = _gateway(worker, config_path, *flag, extra=extra)
    try:
        client = _client(first)
        file_id = _upload(client, [_line(f"r-{i}", max_tokens=5) for i in range(total)])
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
    second = _gateway(worker, config_path, *flag, extra=extra)
    try:
        client = _client(second)
        done = _wait(client, batch.id, {"completed"})
        outputs = _lines(client, done.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"r-{i}" for i in range(total))
        assert done.request_counts is not None and done.request_counts.completed == total
        ran_here = sample(f"{second.url}/metrics", "kvflow_router_tenant_requests_total",
                          tenant="a")  # fmt: skip
        assert ran_here == total - done_before
    finally:
        second.stop()
