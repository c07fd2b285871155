"""HTTP plumbing: bounded JSON bodies, request ids, per-endpoint request counts, disconnects."""

from __future__ import annotations

import json
import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import body_too_large, invalid_request


async def read_json_body(request: Request, limit_bytes: int) -> object:
    """The parsed body; 413 past ``limit_bytes`` (checked while reading, not after)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise body_too_large(limit_bytes)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise body_too_large(limit_bytes)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request ({exc}). Send a JSON object "
            "with Content-Type: application/json."
        ) from exc


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RequestIdMiddleware:
    """Gives every request an id (`x-request-id`, also in error logs) and counts responses
    per endpoint and status. Plain ASGI: no per-request task, unlike BaseHTTPMiddleware."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("x-request-id", request_id)
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_with_id)
