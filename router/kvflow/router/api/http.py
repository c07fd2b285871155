"""HTTP plumbing: bounded JSON bodies, request ids, per-endpoint request counts, disconnects."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Iterable

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.router import tracing
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import body_too_large, invalid_request
from kvflow.router.protocol.strict_json import NotJsonTextError, loads_strict
from kvflow.router.serving.types import new_request_id


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
    return parse_json_body(b"".join(chunks))


def parse_json_body(body: bytes) -> object:
    """The JSON value in ``body``, read strictly (protocol/strict_json.py: no NaN, no
    Infinity, no lone surrogate, UTF-8), or a 400 that says what is wrong with it."""
    try:
        return loads_strict(body)
    except NotJsonTextError as exc:
        if exc.where is not None:
            raise invalid_request(
                f"Invalid '{exc.where}': {exc}. Send valid Unicode text.", param=exc.where
            ) from exc
        raise invalid_request(
            f"We could not parse the JSON body of your request ({exc}). Send a JSON object "
            "with Content-Type: application/json."
        ) from exc
    except RecursionError as exc:  # thousands of nested arrays: Python's parser gives up
        raise invalid_request(
            "The JSON body of your request is nested too deeply to parse. Send a JSON object "
            "whose values nest at most a few hundred levels."
        ) from exc


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# What a caller's `x-request-id` may hold to be used as is: it reaches logs, traces and the
# response header (workers get the gateway's own id), so short and plain (a UUID, a W3C
# trace id, a proxy's "req-..."); anything else is replaced by an id of our own.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:")


def request_id_from(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The caller's `x-request-id` when it is plain enough, else a new id."""
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= MAX_REQUEST_ID_CHARS and set(text) <= _REQUEST_ID_CHARS:
                return text
            break
    return new_request_id()


# The request-state keys under which the completions handler leaves the served name of the
# model whose pool answers and that pool's name (api/completions.py), for
# kvflow_router_model_requests_total.
SERVED_MODEL_STATE = "served_model"
SERVED_POOL_STATE = "served_pool"


class RequestIdMiddleware:
    """Gives every request one id: the caller's `x-request-id`, or a new one; it is sent
    back in the `x-request-id` response header, reaches every worker and log line. Counts
    responses per endpoint and status. Plain ASGI: no per-request task, unlike
    BaseHTTPMiddleware."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("x-request-id", request_id)
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
                # Set by the completions handler once it has picked the model's pool.
                state = scope["state"]
                served_model = state.get(SERVED_MODEL_STATE)
                if served_model is not None:
                    code, pool = str(message["status"]), state.get(SERVED_POOL_STATE, "")
                    self.metrics.model_requests.labels(served_model, code, pool).inc()
            await send(message)

        await self.app(scope, receive, send_with_id)


class TracingMiddleware:
    """One server span per `/v1` request (added only when tracing is on), current while the
    request runs and its stream is sent, so the route and worker-attempt spans nest under
    it. Continues a caller's W3C `traceparent`. Probes and scrapes are not traced."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"] if name == b"traceparent"}  # fmt: skip
        method = scope["method"]
        with tracing.span(f"{method} {path}", tracing.SERVER, tracing.extract(headers)) as span:
            if span is None:  # tracing was turned off (shutdown)
                await self.app(scope, receive, send)
                return
            span.set_attributes({"http.request.method": method, "url.path": path})
            request_id = scope.get("state", {}).get("request_id")
            if request_id:
                span.set_attribute("kvflow.request_id", request_id)

            async def send_with_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(tracing.error_status(f"HTTP {status}"))
                await send(message)

            await self.app(scope, receive, send_with_status)


SSE_KEEPALIVE = b": keep-alive\n\n"


class SseKeepAliveMiddleware:
    """Sends an SSE comment (`: keep-alive`) on an event stream that has been quiet for
    ``interval_s``: a long prefill or a slow model would otherwise leave a proxy's idle
    timeout (often 60 s) to cut the stream, and a client gone away shows up only on a write.
    Clients skip comments (the SSE spec; the openai client does). Only responses with
    `content-type: text/event-stream` get them, once their headers are out."""

    def __init__(self, app: ASGIApp, interval_s: float) -> None:
        self.app = app
        self.interval_s = interval_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        lock = asyncio.Lock()  # one message at a time: a comment never splits an event
        last_sent_s = loop.time()
        is_open = False  # an event stream's headers are out, its end is not
        ticker: asyncio.Task[None] | None = None

        async def tick() -> None:
            nonlocal last_sent_s
            while True:
                await asyncio.sleep(max(0.0, last_sent_s + self.interval_s - loop.time()))
                async with lock:
                    if not is_open:
                        return
                    if loop.time() - last_sent_s >= self.interval_s:
                        await send({"type": "http.response.body", "body": SSE_KEEPALIVE,
                                    "more_body": True})  # fmt: skip
                        last_sent_s = loop.time()

        async def send_with_keepalive(message: Message) -> None:
            nonlocal last_sent_s, is_open, ticker
            if not is_open:
                if message["type"] == "http.response.start" and _is_event_stream(message):
                    is_open = True
                    ticker = asyncio.create_task(tick())
                await send(message)
                return
            async with lock:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    is_open = False
                await send(message)
                last_sent_s = loop.time()

        try:
            await self.app(scope, receive, send_with_keepalive)
        finally:
            is_open = False
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)


def _is_event_stream(message: Message) -> bool:
    for name, value in message.get("headers", ()):
        if name.lower() == b"content-type":
            return bytes(value).startswith(b"text/event-stream")
    return False
