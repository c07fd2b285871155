"""The planner reads whole bodies: a /metrics exposition or a Prometheus answer that arrives
in several pieces is read to its end, and one past the cap is refused, not cut (a real HTTP
server on loopback writes each body in pieces with pauses between them)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from testkit.ports import free_port

from kvflow.operator.observe import prometheus, scrape
from kvflow.operator.observe.exposition import parse
from kvflow.operator.observe.prometheus import PrometheusError, instant_query
from kvflow.operator.observe.scrape import fetch_all

PIECES = 8


def exposition(num_series: int) -> str:
    lines = ["# TYPE kvflow_worker_requests_total counter"]
    lines += [f'kvflow_worker_requests_total{{shard="{i}"}} {i}' for i in range(num_series)]
    return "\n".join(lines) + "\n"


async def serve_in_pieces(body: bytes, method: str, path: str) -> tuple[web.AppRunner, str]:
    """A server that writes ``body`` in ``PIECES`` writes, 20 ms apart."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = "text/plain"
        await response.prepare(request)
        step = -(-len(body) // PIECES)
        for start in range(0, len(body), step):
            await response.write(body[start : start + step])
            await asyncio.sleep(0.02)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route(method, path, answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def with_server(
    body: bytes, method: str, path: str, use: Callable[[str], Awaitable[object]]
) -> object:
    async def run() -> object:
        runner, url = await serve_in_pieces(body, method, path)
        try:
            return await use(url)
        finally:
            await runner.cleanup()

    return asyncio.run(run())


def test_an_exposition_in_pieces_is_scraped_whole() -> None:
    text = exposition(2000)  # about 80 kB, as a gateway with several pools serves
    got = with_server(text.encode(), "GET", "/metrics", lambda url: fetch_all([url + "/metrics"]))
    assert isinstance(got, dict)
    (body,) = got.values()
    assert body == text
    samples = parse(body, frozenset({"kvflow_worker_requests"}))
    assert samples.counters["kvflow_worker_requests"] == sum(range(2000))


def test_an_exposition_past_the_cap_is_a_failed_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scrape, "MAX_BODY_BYTES", 10_000)
    text = exposition(2000)
    got = with_server(text.encode(), "GET", "/metrics", lambda url: fetch_all([url + "/metrics"]))
    assert got == {}


def test_a_prometheus_answer_in_pieces_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    result = [{"metric": {"pod": f"w{i}"}, "value": [0, str(i)]} for i in range(3000)]
    answer = {"status": "success", "data": {"resultType": "vector", "result": result}}
    body = json.dumps(answer).encode()
    got = with_server(body, "POST", "/api/v1/query", lambda url: instant_query(url, "up"))
    assert got == answer["data"]

    monkeypatch.setattr(prometheus, "MAX_BODY_BYTES", len(body) - 1)
    with pytest.raises(PrometheusError, match="an answer over"):
        with_server(body, "POST", "/api/v1/query", lambda url: instant_query(url, "up"))
