"""Tenants end to end: two gateway processes sharing quotas through a real redis-server,
API keys, model permissions, cache isolation, public prefixes, usage, and Redis stopped
in the middle."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import RedisServer, running_redis
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SYSTEM = "You are the support assistant of Example Corp. Answer briefly and politely. " * 4
TENANTS = {
    "alice": {"requests_per_minute": 4},
    "carol": {"models": ["another-model"]},
    "dave": {"admin": True},  # they may see route explanations (x-kvflow-route)
    "erin": {"admin": True},
    "frank": {"requests_per_minute": 2},
    "gina": {"max_concurrent_requests": 1},
}


def key(name: str) -> str:
    return f"sk-{name}-0123456789"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "2",
                       "--num-kv-blocks", "4096"], timeout_s=120)  # fmt: skip
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateways(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, worker: WorkerProcess
) -> Iterator[list[GatewayProcess]]:
    config = {
        "tenants": [
            {"name": name, "api_key_sha256": hash_api_key(key(name)), **limits}
            for name, limits in TENANTS.items()
        ],
        "public_prefixes": [{"system": SYSTEM}],
    }
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    args = ["--served-model-name", MODEL, "--workers", worker.address, "--config", str(path),
            "--redis-url", redis_server.url]  # fmt: skip
    started = []
    try:
        for _ in range(2):
            g = launch_gateway(args)
            started.append(g)
            g.wait_ready()
        yield started
    finally:
        for g in started:
            g.stop()


def client(g: GatewayProcess, tenant: str | None) -> openai.OpenAI:
    api_key = key(tenant) if tenant else "sk-nobody-0000000000"
    return openai.OpenAI(base_url=g.base_url, api_key=api_key, max_retries=0, timeout=60)


def chat(g: GatewayProcess, tenant: str, content: str = "hello", **kw: object):  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": content}]
    return client(g, tenant).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, **kw
    )


def test_keys_and_model_permissions(gateways: list[GatewayProcess]) -> None:
    g = gateways[0]
    r = httpx.post(f"{g.base_url}/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError) as info:
        chat(g, "")  # a key no tenant has
    assert "Incorrect API key provided: sk-***00." in info.value.message
    assert "0000000000" not in info.value.message  # the key is never echoed back
    with pytest.raises(openai.PermissionDeniedError):
        chat(g, "carol")
    assert client(g, "carol").models.list().data == []
    with pytest.raises(openai.NotFoundError):
        client(g, "dave").chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )


def test_rate_limits_are_shared_by_gateway_replicas(gateways: list[GatewayProcess]) -> None:
    outcomes = []
    for i in range(8):
        try:
            chat(gateways[i % 2], "alice")
            outcomes.append("ok")
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"].isdigit()
            assert 1 <= int(exc.response.headers["retry-after"]) <= 16  # 60 s / 4 requests
            body = exc.response.json()["error"]
            assert (body["type"], body["code"]) == ("requests", "rate_limit_exceeded")
            outcomes.append("429")
    assert outcomes == ["ok"] * 4 + ["429"] * 4  # 4 a minute in total, not 4 per replica


def test_concurrency_limit_holds_across_replicas(gateways: list[GatewayProcess]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key('gina')}"}
    with httpx.stream("POST", f"{gateways[0].base_url}/chat/completions", json=body,
                      headers=headers, timeout=60) as stream:  # fmt: skip
        lines = stream.iter_lines()  # keep it: dropping the iterator closes the connection
        first = next(lines)  # gina's one request is running
        assert stream.status_code == 200 and first.startswith("data: "), first
        with pytest.raises(openai.RateLimitError, match="max concurrent requests"):
            chat(gateways[1], "gina")
    deadline = time.monotonic() + 10
    while True:  # the lease is released when the first stream ends
        try:
            chat(gateways[1], "gina")
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def index_blocks(g: GatewayProcess) -> float:
    for line in httpx.get(f"{g.url}/metrics").text.splitlines():
        if line.startswith("kvflow_router_index_blocks "):
            return float(line.split()[1])
    raise AssertionError("no kvflow_router_index_blocks")


def wait_index_grows(g: GatewayProcess, before: float, timeout_s: float = 10) -> None:
    """Until the worker's KV events for the last request reached this router's index."""
    deadline = time.monotonic() + timeout_s
    while index_blocks(g) <= before:
        assert time.monotonic() < deadline, "KV events did not reach the router"
        time.sleep(0.05)


def _route_blocks(
    g: GatewayProcess, tenant: str, messages: list[dict[str, str]]
) -> tuple[int, int]:
    """(prefix blocks the router matched, cached tokens the worker reported)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    headers = {"authorization": f"Bearer {key(tenant)}", "x-kvflow-route": "1"}
    r = httpx.post(f"{g.base_url}/chat/completions", json=body, timeout=60, headers=headers)
    assert r.status_code == 200, r.text
    blocks = int(float(re.search(r"prefix_blocks=([^;]+)", r.headers["x-kvflow-route"]).group(1)))  # type: ignore[union-attr]
    return blocks, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_route_explanations_are_for_admin_tenants_only(gateways: list[GatewayProcess]) -> None:
    # A prompt shorter than a block: it leaves nothing cached for the other tests.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for tenant, shown in (("dave", True), ("gina", False)):
        headers = {"authorization": f"Bearer {key(tenant)}", "x-kvflow-route": "1"}
        r = httpx.post(f"{gateways[0].base_url}/completions", json=body, timeout=60,
                       headers=headers)  # fmt: skip
        assert r.status_code == 200, r.text
        # Worker addresses and scores are the operator's business, not every tenant's.
        assert ("x-kvflow-route" in r.headers) is shown, (tenant, r.headers)


def test_one_tenants_cache_is_invisible_to_another(gateways: list[GatewayProcess]) -> None:
    g = gateways[0]
    private = [{"role": "user", "content": "my secret document: " + "lorem ipsum " * 40}]
    before = index_blocks(g)
    assert _route_blocks(g, "dave", private) == (0, 0)
    wait_index_grows(g, before)
    blocks, cached = _route_blocks(g, "dave", private)
    assert blocks > 5 and cached == blocks * 16
    # Erin sends the very same prompt: no hit at the router, none on the worker.
    assert _route_blocks(g, "erin", private) == (0, 0)


def test_public_prefixes_are_shared_across_tenants(gateways: list[GatewayProcess]) -> None:
    g = gateways[1]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question one"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "other one"}]
    before = index_blocks(g)
    _route_blocks(g, "dave", first)
    wait_index_grows(g, before)
    blocks, cached = _route_blocks(g, "erin", second)
    text = load_text_model(None)
    assert text.chat_template is not None
    rendered = text.chat_template.render([first[0]], add_generation_prompt=False)
    num_public_blocks = len(text.tokenizer.encode(rendered, add_special_tokens=False)) // 16
    assert num_public_blocks >= 3
    assert (blocks, cached) == (num_public_blocks, num_public_blocks * 16)


def test_usage_is_counted_per_tenant_across_replicas(gateways: list[GatewayProcess]) -> None:
    before = httpx.get(f"{gateways[0].base_url}/usage",
                       headers={"authorization": f"Bearer {key('erin')}"}).json()  # fmt: skip
    for g in gateways:
        chat(g, "erin", extra_body={"ignore_eos": True})
    after = httpx.get(f"{gateways[1].base_url}/usage",
                      headers={"authorization": f"Bearer {key('erin')}"}).json()  # fmt: skip
    assert after["tenant"] == "erin" and after["scope"] == "cluster"
    assert after["requests"] - before["requests"] == 2
    assert after["completion_tokens"] - before["completion_tokens"] == 4
    metrics = httpx.get(f"{gateways[0].url}/metrics").text
    assert re.search(
        r'kvflow_router_tenant_completion_tokens_total\{tenant="erin"\} [1-9]', metrics
    )
    assert 'kvflow_router_tenant_rejections_total{limit="requests_per_minute",tenant="alice"}' in (
        httpx.get(f"{gateways[1].url}/metrics").text + httpx.get(f"{gateways[0].url}/metrics").text
    )


def test_redis_stopped_mid_test_degrades_to_per_replica_limits(
    gateways: list[GatewayProcess], redis_server: RedisServer
) -> None:
    redis_server.stop()
    try:
        # Nothing fails because Redis is gone...
        for g in gateways:
            assert chat(g, "dave").choices
        # ...and frank's 2 a minute now hold per replica: 2 on each gateway.
        outcomes = []
        for i in range(6):
            try:
                chat(gateways[i % 2], "frank")
                outcomes.append("ok")
            except openai.RateLimitError:
                outcomes.append("429")
        assert outcomes == ["ok"] * 4 + ["429"] * 2
        usage = httpx.get(f"{gateways[0].base_url}/usage",
                          headers={"authorization": f"Bearer {key('frank')}"}).json()  # fmt: skip
        assert usage["scope"] == "replica"
        assert all("Redis is unreachable" in g.log for g in gateways)
    finally:
        redis_server.start()
    deadline = time.monotonic() + 15
    while True:  # past the retry delay (2 s), the next request finds Redis again
        chat(gateways[0], "dave")
        usage = httpx.get(f"{gateways[0].base_url}/usage",
                          headers={"authorization": f"Bearer {key('dave')}"}).json()  # fmt: skip
        if usage["scope"] == "cluster":
            break
        assert time.monotonic() < deadline, "the gateway did not go back to Redis"
        time.sleep(0.5)
    assert any("reachable again" in line for line in gateways[0].output)
