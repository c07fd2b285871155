"""A real gateway process against scripted workers: failover before the first token, an
error event mid-stream, session affinity, and exactly what reaches the worker (tenant salt,
priority, public prefix blocks)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.tenants.salts import tenant_salt
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer
TOKENS = TOKENIZER.encode(" The quick brown fox jumps", add_special_tokens=False)
TEXT = " The quick brown fox jumps"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def two_workers() -> Iterator[tuple[FakeWorker, FakeWorker, str, str]]:
    # B looks busy, so A is the first choice whenever it is healthy.
    a, b = FakeWorker(tokens=TOKENS), FakeWorker(tokens=TOKENS, num_running=5)
    with running_fake_worker(a) as address_a, running_fake_worker(b) as address_b:
        yield a, b, address_a, address_b


@contextmanager
def gateway_for(*addresses: str, extra: tuple[str, ...] = ()) -> Iterator[GatewayProcess]:
    with running_gateway(["--workers", ",".join(addresses), *extra]) as g:
        g.wait_ready(num_workers=len(addresses))
        yield g


def client_for(g: GatewayProcess, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=api_key, max_retries=0, timeout=30)


def wait_for_log(g: GatewayProcess, fragment: str, timeout_s: float = 10.0) -> bool:
    """The gateway's output arrives on a thread: wait for ``fragment`` to show up."""
    deadline_s = time.monotonic() + timeout_s
    while fragment not in g.log:
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.05)
    return True


def failovers(g: GatewayProcess) -> float:
    for line in httpx.get(f"{g.url}/metrics").text.splitlines():
        if line.startswith("kvflow_router_failovers_total "):
            return float(line.split()[1])
    raise AssertionError("no failover counter")


def test_worker_failing_before_the_first_token_is_failed_over(two_workers) -> None:
    a, b, address_a, address_b = two_workers
    a.mode = "unavailable"
    with gateway_for(address_a, address_b) as g:
        body = {"model": "fake", "messages": MESSAGES}
        r = httpx.post(f"{g.base_url}/chat/completions", json=body,
                       headers={"x-kvflow-route": "1"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == TEXT
        route = r.headers["x-kvflow-route"]
        assert route.index(f"worker={address_a}") < route.index(f"worker={address_b}")
        assert len(a.requests) == 1 and len(b.requests) == 1
        assert failovers(g) == 1
        # Streaming too: the client never sees the failed attempt.
        chunks = list(client_for(g).chat.completions.create(model="fake", messages=MESSAGES,
                                                            stream=True))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT


def test_a_worker_that_aborts_before_the_first_token_is_failed_over(two_workers) -> None:
    a, b, address_a, address_b = two_workers
    a.mode = "aborted"
    with gateway_for(address_a, address_b) as g:
        reply = client_for(g).chat.completions.create(model="fake", messages=MESSAGES)
        assert reply.choices[0].message.content == TEXT
        assert len(a.requests) == 1 and len(b.requests) == 1
        assert failovers(g) == 1


def test_every_worker_failing_is_a_503(two_workers) -> None:
    a, b, address_a, address_b = two_workers
    a.mode = b.mode = "unavailable"
    with gateway_for(address_a, address_b) as g:
        with pytest.raises(openai.InternalServerError) as info:
            client_for(g).chat.completions.create(model="fake", messages=MESSAGES)
        assert info.value.status_code == 503
        assert "fake worker: unavailable" in info.value.message


def test_worker_refusing_the_request_is_a_400_not_a_retry(two_workers) -> None:
    a, b, address_a, address_b = two_workers
    a.mode = "invalid"
    with gateway_for(address_a, address_b) as g:
        with pytest.raises(openai.BadRequestError, match="fake worker: bad request"):
            client_for(g).chat.completions.create(model="fake", messages=MESSAGES)
        assert len(b.requests) == 0


def test_worker_dying_mid_stream_ends_the_stream_with_an_error(two_workers) -> None:
    a, _, address_a, address_b = two_workers
    a.mode, a.die_after = "die", 2
    with gateway_for(address_a, address_b) as g:
        stream = client_for(g).chat.completions.create(model="fake", messages=MESSAGES, stream=True)
        received = ""
        with pytest.raises(openai.APIError, match="mid-stream"):
            for chunk in stream:
                received += chunk.choices[0].delta.content or ""
        assert received == TOKENIZER.decode(TOKENS[:2])
        # Not streaming, nothing reached the client yet: the gateway starts over elsewhere.
        a.mode = "die"
        response = client_for(g).chat.completions.create(model="fake", messages=MESSAGES)
        assert response.choices[0].message.content == TEXT


def test_session_affinity_keeps_a_conversation_on_one_worker() -> None:
    a, b = FakeWorker(tokens=TOKENS), FakeWorker(tokens=TOKENS)
    session = {"x-session-id": "conv-1"}
    with (
        running_fake_worker(a) as address_a,
        running_fake_worker(b) as address_b,
        gateway_for(address_a, address_b, extra=("--seed", "1")) as g,
    ):
        client = client_for(g)
        for _ in range(10):
            client.chat.completions.create(model="fake", messages=MESSAGES, extra_headers=session)
        assert sorted([len(a.requests), len(b.requests)]) == [0, 10]
        # Without a session the tie between two idle workers is broken at random.
        for _ in range(20):
            client.chat.completions.create(model="fake", messages=MESSAGES)
        assert min(len(a.requests), len(b.requests)) >= 3


def test_tenant_salt_priority_and_public_prefix_reach_the_worker(tmp_path: Path) -> None:
    system = "You are the shared assistant of this pool. " * 8  # several full blocks
    config = {
        "tenants": [
            {"name": "alice", "api_key_sha256": hash_api_key("sk-alice"), "priority": 3},
            {"name": "bob", "api_key_sha256": hash_api_key("sk-bob")},
        ],
        "public_prefixes": [{"system": system}],
    }
    config_path = tmp_path / "router.yaml"
    config_path.write_text(yaml.safe_dump(config))
    secret_path = tmp_path / "salt-secret"
    secret_path.write_text("s3cret-of-the-replicas\n")
    worker = FakeWorker(tokens=TOKENS)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    extra = ("--config", str(config_path), "--cache-salt-secret-file", str(secret_path))
    with running_fake_worker(worker) as address, gateway_for(address, extra=extra) as g:
        for key in ("sk-alice", "sk-bob"):
            client_for(g, key).chat.completions.create(model="fake", messages=messages)
        client_for(g, "sk-alice").chat.completions.create(model="fake", messages=MESSAGES)
    alice, bob, alice_private = worker.requests
    # Derived under the replicas' shared secret: the same on each, unguessable without it.
    alice_salt, bob_salt = alice.context.cache_salt, bob.context.cache_salt
    assert alice_salt == tenant_salt(b"s3cret-of-the-replicas", "alice") != bob_salt
    assert bob_salt == tenant_salt(b"s3cret-of-the-replicas", "bob")
    assert (alice.context.priority, bob.context.priority) == (3, 0)
    template = load_text_model(None).chat_template
    assert template is not None
    prefix = TOKENIZER.encode(
        template.render([{"role": "system", "content": system}], add_generation_prompt=False),
        add_special_tokens=False,
    )
    public = len(prefix) // 16
    assert alice.context.num_public_blocks == bob.context.num_public_blocks == public > 2
    assert alice_private.context.num_public_blocks == 0  # the default system prompt is not public
    assert Counter(r.prompt_token_ids[0] for r in worker.requests) == Counter({1: 3})


def test_the_callers_request_id_stays_in_the_response_and_log_never_on_a_worker(
    two_workers,
) -> None:
    a, b, address_a, address_b = two_workers
    a.mode = "unavailable"
    with gateway_for(address_a, address_b) as g:
        body = {"model": "fake", "messages": MESSAGES}
        r = httpx.post(f"{g.base_url}/chat/completions", json=body,
                       headers={"x-request-id": "trace-7f3a"})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "trace-7f3a"
        # The workers get the gateway's own id, suffixed per choice and attempt: a caller
        # reusing an id (or guessing another's) cannot collide with a request on a worker.
        (sent_a,) = [q.request_id for q in a.requests]
        (sent_b,) = [q.request_id for q in b.requests]
        assert "trace-7f3a" not in sent_a + sent_b
        server_id = sent_a.removesuffix("-c0-a0")
        assert server_id.startswith("req_") and sent_b == f"{server_id}-c0-a1"
        assert f"{sent_a}: failing over" in g.log
        # The request's log line ties the two together.
        assert wait_for_log(g, f"request_id=trace-7f3a server_id={server_id} ")
        # The same id again: again a fresh one on the worker.
        b.requests.clear()
        r = httpx.post(f"{g.base_url}/chat/completions", json=body,
                       headers={"x-request-id": "trace-7f3a"})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7f3a"
        (again,) = [q.request_id for q in b.requests]
        assert again.startswith("req_") and not again.startswith(server_id)
        a.mode = "ok"
        a.requests.clear()
        r = httpx.post(f"{g.base_url}/chat/completions", json={**body, "n": 2},
                       headers={"x-request-id": "bad id with spaces"})  # fmt: skip
        assert r.status_code == 200, r.text
        made = r.headers["x-request-id"]
        assert made.startswith("req_")
        sent = sorted(q.request_id for q in a.requests + b.requests[1:])
        assert sent == [f"{made}-c0-a0", f"{made}-c1-a0"]
        # Without the header the gateway makes one, as before.
        r = httpx.post(f"{g.base_url}/chat/completions", json=body)
        assert r.headers["x-request-id"].startswith("req_") and r.headers["x-request-id"] != made
