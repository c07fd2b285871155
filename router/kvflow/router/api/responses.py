"""``POST /v1/responses``: the Responses API, answered on the chat path.

authenticate (401) -> the body as a chat request (protocol/responses_api.py: 400s name the
Responses parameter) -> ``handle_completion`` as for ``/v1/chat/completions``, with this
request's headers (session, priority class, route debug) and its disconnect -> the chat
answer as a Response, or its SSE chunks as the Response's events. ``GET`` and ``DELETE
/v1/responses/{id}`` say that kvflow keeps no responses (404).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from kvflow.router.api.completions import handle_completion
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import read_json_body
from kvflow.router.api.streaming import ManagedStreamingResponse
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.responses_api import (
    ResponseEcho,
    ResponseEvents,
    chat_request,
    renamed,
    response_object,
    sse,
)
from kvflow.router.tenants.config import Tenant

_PASSED_HEADERS = frozenset({"content-length", "content-type"})  # the chat answer's own


async def handle_response(request: Request, *, tenant: Tenant | None = None) -> Response:
    """``tenant``: the caller already known (a batch's line, batch/runner.py), else from
    the request's API key."""
    gw: Gateway = request.app.state.gateway
    if tenant is None:
        tenant = gw.authenticate(request.headers)
    body = await read_json_body(request, gw.settings.config.max_body_bytes)
    chat, echo = chat_request(body)
    try:
        answer = await handle_completion(_as_chat(request, chat), is_chat=True, tenant=tenant)
    except ApiError as exc:
        raise renamed(exc) from None
    headers = {k: v for k, v in answer.headers.items() if k not in _PASSED_HEADERS}
    if isinstance(answer, ManagedStreamingResponse):
        return answer.rewritten(lambda chunks: _events(chunks, echo), headers)
    if answer.status_code != 200:  # the client left (499): nobody reads it
        return answer
    return JSONResponse(response_object(json.loads(bytes(answer.body)), echo), headers=headers)


def no_stored_response(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"No response '{response_id}': kvflow keeps no responses; each request carries its "
        "whole conversation in 'input'.",
        param="response_id",
        code="response_not_found",
    )


def _as_chat(request: Request, chat: dict[str, Any]) -> Request:
    """This request, its body the chat request: the same headers and client, and its
    receive after the body, so the chat path sees the client leave."""
    payload = json.dumps(chat).encode()
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
    headers.append((b"content-length", str(len(payload)).encode()))
    scope = {**request.scope, "headers": headers, "path": "/v1/chat/completions"}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        return await request.receive()

    return Request(scope, receive)


async def _events(chunks: AsyncIterator[bytes], echo: ResponseEcho) -> AsyncIterator[bytes]:
    """The chat stream's ``data:`` events as the Response's events."""
    events = ResponseEvents(echo)
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *frames, pending = pending.split(b"\n\n")
        for frame in frames:
            for line in frame.split(b"\n"):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                parsed = json.loads(line[len(b"data: ") :])
                for event in events.chunk(parsed):
                    yield sse(event)
                if "error" in parsed:
                    return
    for event in events.end():
        yield sse(event)
