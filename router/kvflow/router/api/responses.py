"""``/v1/responses``: the Responses API, answered on the chat path.

POST: authenticate (401) -> the body as a chat request (protocol/responses_api.py: 400s
name the Responses parameter), after the stored conversation of ``previous_response_id``
(404 if this tenant has no such response) -> ``handle_completion`` as for
``/v1/chat/completions``, with this request's headers (session, priority class, route
debug) and its disconnect -> the chat answer as a Response, or its SSE chunks as the
Response's events -> stored with its conversation (``store``, the default; a failed one
is not). GET and DELETE ``/v1/responses/{id}``: the tenant's stored Response; GET
``/v1/responses/{id}/input_items``: its request's input, a page of items.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from kvflow.router.api.completions import handle_completion
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import read_json_body
from kvflow.router.api.response_store import ResponseStore, ResponseStoreError, StoredResponse
from kvflow.router.api.streaming import ManagedStreamingResponse
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.input_items import input_items, item_page
from kvflow.router.protocol.response_events import ResponseEvents, response_object, sse
from kvflow.router.protocol.responses_api import (
    ResponseEcho,
    chat_request,
    continued,
    conversation,
    renamed,
)
from kvflow.router.tenants.config import Tenant

log = logging.getLogger("kvflow.router.api")
T = TypeVar("T")
_PASSED_HEADERS = frozenset({"content-length", "content-type"})  # the chat answer's own


async def handle_response(request: Request, *, tenant: Tenant | None = None) -> Response:
    """``tenant``: the caller already known (a batch's line, batch/runner.py), else from
    the request's API key."""
    gw: Gateway = request.app.state.gateway
    if tenant is None:
        tenant = gw.authenticate(request.headers)
    body = await read_json_body(request, gw.settings.config.max_body_bytes)
    chat, echo = chat_request(body)
    store: ResponseStore = request.app.state.responses
    history: list[Any] = []
    if echo.previous_response_id is not None:
        previous = await _read(store.get(tenant.name, echo.previous_response_id))
        if previous is None:
            raise ApiError(404, f"Previous response with id '{echo.previous_response_id}' not "
                           "found.", param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
        history = previous.conversation
        chat = continued(chat, echo, history)
    try:
        answer = await handle_completion(_as_chat(request, chat), is_chat=True, tenant=tenant)
    except ApiError as exc:
        raise renamed(exc) from None
    keep = _keeper(store, tenant.name, echo, history)
    headers = {k: v for k, v in answer.headers.items() if k not in _PASSED_HEADERS}
    if isinstance(answer, ManagedStreamingResponse):
        return answer.rewritten(lambda chunks: _events(chunks, echo, keep), headers)
    if answer.status_code != 200:  # the client left (499): nobody reads it
        return answer
    response = response_object(json.loads(bytes(answer.body)), echo)
    await keep(response)
    return JSONResponse(response, headers=headers)


async def stored_response(request: Request, response_id: str, *, delete: bool) -> dict[str, Any]:
    """GET or DELETE ``/v1/responses/{response_id}`` for the caller's tenant."""
    gw: Gateway = request.app.state.gateway
    tenant = gw.authenticate(request.headers)
    store: ResponseStore = request.app.state.responses
    if delete:
        if not await _read(store.delete(tenant.name, response_id)):
            raise no_stored_response(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
    found = await _read(store.get(tenant.name, response_id))
    if found is None:
        raise no_stored_response(response_id)
    return found.response


async def stored_input_items(request: Request, response_id: str) -> dict[str, Any]:
    """GET ``/v1/responses/{response_id}/input_items`` for the caller's tenant: a page of
    its request's input items (protocol/input_items.py)."""
    gw: Gateway = request.app.state.gateway
    tenant = gw.authenticate(request.headers)
    query = {name: request.query_params.getlist(name) for name in request.query_params}
    store: ResponseStore = request.app.state.responses
    found = await _read(store.get(tenant.name, response_id))
    if found is None:
        raise no_stored_response(response_id)
    return item_page(found.input_items, query)


Keeper = Callable[[dict[str, Any]], Awaitable[None]]


def _keeper(store: ResponseStore, tenant: str, echo: ResponseEcho, history: list[Any]) -> Keeper:
    """Stores a finished response with its conversation, when the request asked for it."""

    async def keep(response: dict[str, Any]) -> None:
        if echo.store and response["status"] in ("completed", "incomplete"):
            kept = StoredResponse(response, conversation(echo, history, response),
                                  input_items(echo.input, response["id"]))  # fmt: skip
            try:
                await store.put(tenant, kept)
            except ResponseStoreError as exc:  # the answer still goes out, said to be unkept
                log.warning("response %s not stored: %s", response["id"], exc)
                response["store"] = False

    return keep


async def _read(call: Awaitable[T]) -> T:
    """A store read the request needs: 503 while the store fails."""
    try:
        return await call
    except ResponseStoreError as exc:
        log.warning("stored responses unavailable: %s", exc)  # its address stays in the log
        raise ApiError(503, "Stored responses are unavailable for now; retry, or send the "
                       "whole conversation in 'input'.", type="server_error",
                       code="response_store_unavailable", retry_after_s=1.0) from exc  # fmt: skip


def no_stored_response(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"No response with id '{response_id}' is stored for this API key (responses sent "
        "with store: false are not kept; stored ones expire after 30 days).",
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


async def _events(
    chunks: AsyncIterator[bytes], echo: ResponseEcho, keep: Keeper
) -> AsyncIterator[bytes]:
    """The chat stream's ``data:`` events as the Response's events; the last one's
    Response is stored."""
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
        if event["type"] in ("response.completed", "response.incomplete"):
            await keep(event["response"])  # before the client reads it: a follow-up finds it
        yield sse(event)
