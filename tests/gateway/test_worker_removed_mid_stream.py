"""A worker that leaves the pool mid-request is a worker fault like any other, as is one
that aborts a request after its first token.

`WorkerPool.set_addresses` (what `--worker-dns` runs every few seconds, and so what a pod
the operator scales away does) closes a removed worker's gRPC channel, which cancels its
calls in flight. A request on it must fail over before its client saw anything, or end
with an error event after it did; never hang with its tenant's slots held.

The gateway runs in this test's event loop (the real app, served by uvicorn on a loopback
port, the real pool dialling scripted gRPC workers), so the test can call `set_addresses`
itself at the moment it wants: a separate process re-resolves DNS on its own clock.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from testkit.fake_worker import FakeWorker, running_fake_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.router.api.app import create_app
from kvflow.router.api.gateway import Gateway, build_gateway
from kvflow.router.cli import parse_args
from kvflow.router.serving.tenant_gate import TenantGate
from kvflow.router.tenants.config import ANONYMOUS
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer
TEXT = " The quick brown fox jumps over the lazy dog"
TOKENS = TOKENIZER.encode(TEXT, add_special_tokens=False)
MESSAGES = [{"role": "user", "content": "hi"}]
# Slow enough that the worker is removed while the request streams from it.
SLOW_TOKEN_S = 0.3
# The first token that far off: the worker is removed before it, however loaded the machine.
FAR_FIRST_TOKEN_S = 5.0
# Far longer than any answer here takes, far shorter than a hang.
ANSWER_TIMEOUT_S = 10.0


class ServedGateway:
    def __init__(self, url: str, gateway: Gateway, gate: TenantGate) -> None:
        self.url = url
        self.gateway = gateway
        self._gate = gate

    async def remove_all_but(self, address: str) -> None:
        """What discovery does when ``address`` is the only worker left to resolve."""
        await self.gateway.backends[0].pool.set_addresses([address])

    def num_in_flight(self) -> int:
        """Requests the tenant gate counts as running (released when a response ends)."""
        return self._gate.num_in_flight(ANONYMOUS.name)


@asynccontextmanager
async def serving_gateway(*addresses: str) -> AsyncIterator[ServedGateway]:
    settings = parse_args(["--workers", ",".join(addresses)])
    assert settings is not None
    gateway = build_gateway(settings)
    app = create_app(gateway)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            pool = gateway.backends[0].pool
            while not (server.started and pool.num_healthy() == len(addresses)):
                assert not serving.done(), "the gateway stopped while starting"
                await asyncio.sleep(0.05)
        gate = app.state.tenant_gate = TenantGate()  # what the app would make on first use
        yield ServedGateway(f"http://127.0.0.1:{sock.getsockname()[1]}/v1", gateway, gate)
    finally:
        server.should_exit = True
        await serving
        sock.close()


@pytest.fixture
def two_workers() -> Iterator[tuple[FakeWorker, FakeWorker, str, str]]:
    # B looks busy, so A is the first choice while it is in the pool.
    a = FakeWorker(tokens=TOKENS, token_delay_s=SLOW_TOKEN_S)
    b = FakeWorker(tokens=TOKENS, num_running=5)
    with running_fake_worker(a) as address_a, running_fake_worker(b) as address_b:
        yield a, b, address_a, address_b


def _http() -> httpx.AsyncClient:
    # Its own read timeout past the test's: a hang fails as one, at ANSWER_TIMEOUT_S.
    return httpx.AsyncClient(timeout=2 * ANSWER_TIMEOUT_S)


def _body(*, stream: bool) -> dict[str, object]:
    return {"model": "fake", "messages": MESSAGES, "stream": stream}


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, object] | str]:
    """A stream's SSE data payloads: parsed JSON, or the literal "[DONE]"."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def _parsed(body: str) -> list[dict[str, object] | str]:
    """A whole SSE body's data payloads, as `_events` yields them."""
    data = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def _content(event: dict[str, object] | str) -> str:
    if isinstance(event, str) or "choices" not in event:
        return ""
    choices = event["choices"]
    assert isinstance(choices, list)
    return "".join(c["delta"].get("content") or "" for c in choices)


async def _wait_for_request(worker: FakeWorker) -> None:
    """Until ``worker`` has the request."""
    while not worker.requests:
        await asyncio.sleep(0.01)


async def _released(g: ServedGateway) -> bool:
    """Whether the request's slots are given back (just after its last byte, at the latest)."""
    for _ in range(100):
        if g.num_in_flight() == 0:
            return True
        await asyncio.sleep(0.01)
    return False


def test_a_worker_removed_after_the_first_token_ends_the_stream_with_an_error(
    two_workers: tuple[FakeWorker, FakeWorker, str, str],
) -> None:
    a, b, address_a, address_b = two_workers

    async def scenario() -> None:
        async with serving_gateway(address_a, address_b) as g, _http() as http:
            events: list[dict[str, object] | str] = []
            is_removed = False
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                request = http.stream("POST", f"{g.url}/chat/completions",
                                      json=_body(stream=True))  # fmt: skip
                async with request as response:
                    assert response.status_code == 200
                    async for event in _events(response):
                        events.append(event)
                        if _content(event) and not is_removed:  # its first token
                            await g.remove_all_but(address_b)
                            is_removed = True
            received = "".join(_content(e) for e in events)
            assert received and TEXT.startswith(received) and received != TEXT
            error = events[-1]
            assert isinstance(error, dict) and "error" in error, events
            assert "mid-stream" in str(error["error"]), error
            assert "[DONE]" not in events
            # The client had seen text: no retry elsewhere.
            assert len(a.requests) == 1 and not b.requests
            assert await _released(g)
            # The gateway serves on, from the worker left.
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                r = await http.post(f"{g.url}/chat/completions", json=_body(stream=False))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == TEXT

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
def test_a_worker_removed_before_the_first_token_is_failed_over(
    two_workers: tuple[FakeWorker, FakeWorker, str, str], stream: bool
) -> None:
    a, b, address_a, address_b = two_workers
    a.token_delay_s = FAR_FIRST_TOKEN_S

    async def scenario() -> None:
        async with serving_gateway(address_a, address_b) as g, _http() as http:
            post = asyncio.create_task(
                http.post(f"{g.url}/chat/completions", json=_body(stream=stream))
            )
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                await _wait_for_request(a)
                await g.remove_all_but(address_b)
                r = await post
            assert r.status_code == 200, r.text
            if stream:
                events = _parsed(r.text)
                assert "".join(_content(e) for e in events) == TEXT
                assert events[-1] == "[DONE]"
            else:
                assert r.json()["choices"][0]["message"]["content"] == TEXT
            assert len(a.requests) == 1 and len(b.requests) == 1
            assert await _released(g)

    asyncio.run(scenario())


# -- a worker that aborts a request after its first token ------------------------------------


@dataclass
class AbortingWorker(FakeWorker):
    """Streams ``abort_after`` tokens, then finishes the request as aborted: a failed engine
    step, a lost tensor-parallel rank, a drain past its grace, mid-decode."""

    abort_after: int = 2

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        for token in self.tokens[: self.abort_after]:
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[token])
        yield pb.GenerateResponse(request_id=request.request_id,
                                  finish_reason=pb.FINISH_REASON_ABORT)  # fmt: skip


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
def test_a_worker_aborting_after_its_first_token_fails_over_unless_the_client_saw_it(
    stream: bool,
) -> None:
    a = AbortingWorker(tokens=TOKENS)
    b = FakeWorker(tokens=TOKENS, num_running=5)  # looks busy: A is the first choice

    async def scenario(address_a: str, address_b: str) -> None:
        async with serving_gateway(address_a, address_b) as g, _http() as http:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                r = await http.post(f"{g.url}/chat/completions", json=_body(stream=stream))
            assert r.status_code == 200, r.text
            if stream:  # the client saw text: the stream ends with an error event
                events = _parsed(r.text)
                received = "".join(_content(e) for e in events)
                assert received == TOKENIZER.decode(TOKENS[:2])
                error = events[-1]
                assert isinstance(error, dict) and "error" in error, events
                assert "aborted the request" in str(error["error"]), error
                assert "[DONE]" not in events and not b.requests
            else:  # it saw nothing: another worker answers in full
                assert r.json()["choices"][0]["message"]["content"] == TEXT
                assert len(a.requests) == 1 and len(b.requests) == 1
            assert await _released(g)

    with running_fake_worker(a) as address_a, running_fake_worker(b) as address_b:
        asyncio.run(scenario(address_a, address_b))
