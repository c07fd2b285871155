"""What a Prometheus address answers never reaches the pool's status (a real HTTP server on
loopback stands in for any address a pool might name)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from testkit.ports import free_port

from kvflow.operator.observe.prometheus import PrometheusError, instant_query
from kvflow.operator.observe.promql import AnswerError, fold

SECRET = "s3cr3t-from-the-metadata-service"


async def serve(body: object, status: int = 200) -> tuple[web.AppRunner, str]:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps(body), status=status)

    app = web.Application()
    app.router.add_post("/api/v1/query", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"status": "error", "errorType": "bad_data", "error": SECRET}, "bad_data"),
        ({"status": "error", "errorType": SECRET, "error": SECRET}, "an error"),
        ({"status": "success", "data": {"resultType": SECRET}}, None),
    ],
)
def test_an_answer_is_summarized_never_copied(body: object, named: str | None) -> None:
    async def run() -> str:
        runner, url = await serve(body, 400 if named else 200)
        try:
            data = await instant_query(url, "up")
            try:
                fold(data)
            except AnswerError as exc:
                return str(exc)
            return "no error"
        except PrometheusError as exc:
            return str(exc)
        finally:
            await runner.cleanup()

    message = asyncio.run(run())
    assert SECRET not in message
    if named:
        assert named in message
    else:
        assert message == "the answer is not an instant vector"
