"""Limits at the model, client-IP and global levels, end to end: real gateway processes
sharing one redis-server (router replicas), in front of a scripted worker.

- a model's in-flight slot is shared by the replicas, renewed while its request runs past
  the lease TTL, and freed at once when the client leaves;
- the slot of a replica killed mid-request is freed by the lease's expiry;
- a global limit holds across replicas, each request counted once;
- the client is the peer unless the peer is a trusted proxy (then X-Forwarded-For's
  right-most untrusted address);
- every refusal is a 429 with Retry-After and x-kvflow-limit naming the limit.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import RedisServer, running_redis

from kvflow.proto import worker_pb2 as pb
from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "fake"
LEASE_TTL_S = 4.0
PROXY = "127.0.0.2"  # the trusted proxy: loopback, but not the address tests usually use
HOLD = 100  # max_tokens from which the worker holds the stream open until cancelled
# Tokens that detokenize to text (the gateway answers once there is some).
TOKENS = load_text_model(None).tokenizer.encode(" The quick brown fox", add_special_tokens=False)


@dataclass
class HoldingWorker(FakeWorker):
    """Answers short requests at once; holds a long one open after its first token."""

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request.sampling.max_tokens < HOLD:
            async for response in super().Generate(request, context):
                yield response
            return
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=[self.tokens[0]])
        await asyncio.Event().wait()  # until the gateway cancels the call


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
def worker_address() -> Iterator[str]:
    with running_fake_worker(HoldingWorker(model=MODEL, tokens=TOKENS)) as address:
        yield address


def _args(
    tmp: Path, name: str, limits: dict[str, Any], worker: str, redis: RedisServer
) -> list[str]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"rate_limits": limits}))
    return ["--workers", worker, "--config", str(path), "--redis-url", redis.url,
            "--quota-scope", name]  # fmt: skip


@pytest.fixture(scope="module")
def p1_args(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, worker_address: str
) -> list[str]:
    limits = {
        "models": {MODEL: {"max_in_flight": 1}},
        "client_ip": {"requests_per_minute": 2},
        "trusted_proxy_cidrs": [f"{PROXY}/32"],
        "lease_ttl_s": LEASE_TTL_S,
    }
    return _args(tmp_path_factory.mktemp("p1"), "p1", limits, worker_address, redis_server)


def _launch_pair(args: list[str]) -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    try:
        for _ in range(2):
            g = launch_gateway(args)
            started.append(g)
            g.wait_ready()
        yield started
    finally:
        for g in started:
            g.stop()


@pytest.fixture(scope="module")
def pair(p1_args: list[str]) -> Iterator[list[GatewayProcess]]:
    """Two replicas: one model's in-flight slot, 2 requests a minute per client address,
    X-Forwarded-For believed from PROXY only."""
    yield from _launch_pair(p1_args)


def post(
    g: GatewayProcess,
    *,
    client: str | None = None,
    peer: str = "127.0.0.1",
    max_tokens: int = 2,
) -> httpx.Response:
    """A chat completion from ``peer``; ``client``: the X-Forwarded-For it sends."""
    headers = {"x-forwarded-for": client} if client is not None else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}  # fmt: skip
    with httpx.Client(transport=httpx.HTTPTransport(local_address=peer), timeout=30) as c:
        return c.post(f"{g.base_url}/chat/completions", json=body, headers=headers)


def assert_limited(r: httpx.Response, limit: str, *, max_retry_after_s: int = 60) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["x-kvflow-limit"] == limit
    assert 1 <= int(r.headers["retry-after"]) <= max_retry_after_s
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and limit in error["message"], error


def rejections(gateways: list[GatewayProcess], level: str, kind: str) -> float:
    pattern = re.compile(
        rf'^kvflow_router_limit_rejections_total\{{level="{level}",limit="{kind}"\}} (\S+)$', re.M
    )
    total = 0.0
    for g in gateways:
        found = pattern.search(httpx.get(f"{g.url}/metrics").text)
        assert found is not None, f"no {level}/{kind} series"
        total += float(found.group(1))
    return total


class HeldStream:
    """A streamed request held open by the worker: it holds its slots until closed."""

    def __init__(self, g: GatewayProcess, client: str) -> None:
        self._client = httpx.Client(transport=httpx.HTTPTransport(local_address=PROXY),
                                    timeout=30)  # fmt: skip
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hold"}],
                "max_tokens": HOLD, "stream": True}  # fmt: skip
        self._cm = self._client.stream("POST", f"{g.base_url}/chat/completions", json=body,
                                       headers={"x-forwarded-for": client})  # fmt: skip
        response = self._cm.__enter__()
        assert response.status_code == 200, response.read()
        self._lines = response.iter_lines()  # kept: dropping it closes the connection
        assert next(self._lines).startswith("data: ")  # admitted and running

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self._client.close()


def wait_admitted(g: GatewayProcess, client: str, timeout_s: float) -> float:
    """Seconds until a request from ``client`` (through the proxy) is admitted."""
    started = time.monotonic()
    while True:
        r = post(g, client=client, peer=PROXY)
        if r.status_code == 200:
            return time.monotonic() - started
        assert_limited(r, f"model/{MODEL}/max_in_flight")
        assert time.monotonic() - started < timeout_s, "the in-flight slot was not freed"
        time.sleep(0.05)


def test_model_in_flight_is_shared_renewed_and_freed_when_the_client_leaves(
    pair: list[GatewayProcess],
) -> None:
    a, b = pair
    held = HeldStream(a, "198.51.100.10")
    try:
        time.sleep(LEASE_TTL_S * 1.5)  # past the lease's TTL: renewed by its replica
        r = post(b, client="198.51.100.11", peer=PROXY)
        assert_limited(r, f"model/{MODEL}/max_in_flight", max_retry_after_s=1)
        assert r.json()["error"]["type"] == "requests"
        assert rejections(pair, "model", "max_in_flight") == 1
    finally:
        held.close()
    # Freed when the client left, well before the lease could have expired.
    assert wait_admitted(b, "198.51.100.12", timeout_s=LEASE_TTL_S / 2) < LEASE_TTL_S / 2


def test_slot_of_a_replica_killed_mid_request_is_freed_at_the_lease_expiry(
    pair: list[GatewayProcess], p1_args: list[str]
) -> None:
    doomed = launch_gateway(p1_args)
    try:
        doomed.wait_ready()
        HeldStream(doomed, "198.51.100.20")  # never closed: its replica dies holding it
        doomed.stop(sig=signal.SIGKILL)
        died_s = time.monotonic()
        assert_limited(post(pair[0], client="198.51.100.21", peer=PROXY),
                       f"model/{MODEL}/max_in_flight")  # fmt: skip
        waited_s = wait_admitted(pair[1], "198.51.100.22", timeout_s=LEASE_TTL_S + 3)
        # Not before its expiry: it was renewed at most a third of the TTL before the kill.
        assert time.monotonic() - died_s >= LEASE_TTL_S * 2 / 3 - 0.5, waited_s
    finally:
        doomed.stop(sig=signal.SIGKILL)


def test_client_ip_ignores_x_forwarded_for_from_an_untrusted_peer(
    pair: list[GatewayProcess],
) -> None:
    # Each request claims another address; the peer (127.0.0.1) is no trusted proxy, so
    # all of them are one client, counted across both replicas.
    codes = [post(pair[i % 2], client=f"203.0.113.{i}").status_code for i in range(2)]
    assert codes == [200, 200]
    r = post(pair[0], client="203.0.113.9")
    assert_limited(r, "client_ip/127.0.0.1/requests_per_minute", max_retry_after_s=30)


def test_client_ip_behind_a_trusted_proxy_is_the_right_most_untrusted_address(
    pair: list[GatewayProcess],
) -> None:
    # The client forges addresses to the left of what the proxy appended: they change
    # nothing, the proxy's entry is the client.
    forged = ["6.6.6.1, 203.0.113.50", "6.6.6.2, 203.0.113.50"]
    assert [
        post(g, client=f, peer=PROXY).status_code for g, f in zip(pair, forged, strict=True)
    ] == [200, 200]
    r = post(pair[0], client="6.6.6.3, 203.0.113.50", peer=PROXY)
    assert_limited(r, "client_ip/203.0.113.50/requests_per_minute", max_retry_after_s=30)
    # Another client behind the same proxy has its own limit.
    assert post(pair[1], client="203.0.113.51", peer=PROXY).status_code == 200
    assert rejections(pair, "client_ip", "requests_per_minute") >= 1


@pytest.fixture(scope="module")
def global_pair(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, worker_address: str
) -> Iterator[list[GatewayProcess]]:
    """Two replicas with 4 requests a minute for the whole gateway."""
    limits = {"global": {"requests_per_minute": 4}}
    tmp = tmp_path_factory.mktemp("global")
    yield from _launch_pair(_args(tmp, "global", limits, worker_address, redis_server))


def test_global_limit_holds_across_replicas(global_pair: list[GatewayProcess]) -> None:
    responses = [post(global_pair[i % 2]) for i in range(6)]
    assert [r.status_code for r in responses] == [200] * 4 + [429] * 2  # 4 in all, not each
    for r in responses[4:]:
        assert_limited(r, "global/requests_per_minute", max_retry_after_s=15)  # 60 s / 4
    assert rejections(global_pair, "global", "requests_per_minute") == 2


def key(name: str) -> str:
    return f"sk-{name}-0123456789"


def test_a_request_the_tenant_refuses_gives_back_what_the_levels_took(
    tmp_path: Path, redis_server: RedisServer, worker_address: str
) -> None:
    # Alice's tokens per minute pass the check before her prompt is prepared (it counts
    # only max_tokens) and refuse the admission after it (prompt + max_tokens): by then the
    # levels have admitted the request, and must give it back.
    text = load_text_model(None)
    assert text.chat_template is not None
    rendered = text.chat_template.render([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True)  # fmt: skip
    prompt_tokens = len(text.tokenizer.encode(rendered, add_special_tokens=False))
    tenants = [
        {"name": "alice", "api_key_sha256": hash_api_key(key("alice")),
         "tokens_per_minute": prompt_tokens + 9},
        {"name": "bob", "api_key_sha256": hash_api_key(key("bob"))},
    ]  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(
        {"tenants": tenants, "rate_limits": {"global": {"requests_per_minute": 3}}}
    ))  # fmt: skip
    g = launch_gateway(["--workers", worker_address, "--config", str(path), "--redis-url",
                        redis_server.url, "--quota-scope", "cancel"])  # fmt: skip
    try:
        g.wait_ready()

        def chat(tenant: str) -> httpx.Response:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}  # fmt: skip
            return httpx.post(f"{g.base_url}/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {key(tenant)}"})  # fmt: skip

        assert chat("alice").status_code == 200
        refused = chat("alice")
        assert refused.status_code == 429 and "tokens per minute" in refused.text
        assert "x-kvflow-limit" not in refused.headers  # the tenant's, not a level's
        # Alice's refused request took nothing from the gateway's 3 a minute.
        assert [chat("bob").status_code for _ in range(2)] == [200, 200]
        assert_limited(chat("bob"), "global/requests_per_minute", max_retry_after_s=20)
    finally:
        g.stop()
