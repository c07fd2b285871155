"""Connection-level limits of the gateway's HTTP listener, which uvicorn's httptools
protocol lacks: it buffers a request's headers without bound, waits forever for a
connection that sends nothing (or one byte a minute), accepts any number of connections,
and lets a response wait forever on a client that stopped reading it (its concurrency slot
and quota lease held all along).

`limited_protocol(limits, on_refusal)` is the protocol class uvicorn is given (`http=`):

- the request line and headers may take at most ``max_header_bytes`` (431) and must arrive
  within ``header_timeout_s`` of the connection or of the request's first byte (408);
- the body must arrive within ``body_timeout_s`` of the headers' end (408): a client
  dribbling its body would hold its connection, and the handler waiting on it, forever;
- past ``max_connections`` open connections, a new one's request is answered 503;
- a response whose writes stay blocked (the client reads nothing, the buffers are full)
  for ``write_timeout_s`` is cut: the connection is aborted, so the app sees a disconnect
  and frees what the request held (api/streaming.py).

Refusals are written by the protocol itself, in OpenAI's error shape, with
``connection: close``; the connection then reads and drops what the client still sends for
a moment (a lingering close), so the client reads the answer rather than a reset.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvflow.router.http")

# 64 KiB: nginx's default header buffers are 4 x 8 KiB and Envoy's limit is 60 KiB; a real
# client's request line and headers (a bearer key, a traceparent) take well under 4 KiB.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# Slowloris: a client trickling its headers holds a connection; a real one sends them at once.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Each connection costs a file descriptor and a little memory; a router's fd limit is
# usually 1,048,576 in a container, and far fewer concurrent clients are expected.
DEFAULT_MAX_CONNECTIONS = 8192
# A request body after its headers: 8 MiB (the default --max-body-bytes) in 30 s needs
# under 300 KB/s; a real client sends a body at once, right after its headers.
DEFAULT_BODY_TIMEOUT_S = 30.0
# A client (or proxy) that reads nothing of a response for this long is gone or hostile.
DEFAULT_WRITE_TIMEOUT_S = 30.0
# Well below the usual proxy idle timeouts (60 s for nginx and AWS ALB; Envoy: 1 h).
DEFAULT_SSE_KEEPALIVE_INTERVAL_S = 15.0
# After a refusal, how long what the client still sends is read and dropped.
REFUSAL_LINGER_S = 2.0
# How long a client refused for too many connections is asked to wait.
CONNECTIONS_RETRY_AFTER_S = 1

# Refusal reasons: the label values of kvflow_router_http_refusals_total.
REFUSAL_REASONS = ("header_too_large", "header_timeout", "body_timeout",
                   "too_many_connections", "write_timeout")  # fmt: skip


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S


def refusal_bytes(status: int, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape, closing the connection. Pure."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"
                                 if status < 500 else "server_error",
                                 "param": None, "code": code}}).encode()  # fmt: skip
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close"]  # fmt: skip
    if retry_after_s is not None:
        head.append(f"retry-after: {retry_after_s}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's protocol with the limits above; `limited_protocol` sets the class fields."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    body_timeout_s: ClassVar[float] = DEFAULT_BODY_TIMEOUT_S
    on_refusal: ClassVar[Callable[[str], None]] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes the current request's line and headers may still take; None: they are in.
        self._header_budget: int | None = self.limits.max_header_bytes
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._is_over_capacity = False
        self._is_refused = False

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Counted here, answered once the request is read: a reply before it may be lost.
        self._is_over_capacity = len(self.connections) > self.limits.max_connections
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        # A refused client that has read its answer and closed: done lingering.
        if self._is_refused:
            self.transport.close()

    # -- request line and headers ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return  # lingering: read and dropped
        budget = self._header_budget
        if budget is None or len(data) <= budget:
            if budget is not None:
                self._header_budget = budget - len(data)
            super().data_received(data)
            return
        # Feed what the budget allows: if the headers end within it, the rest is body.
        self._header_budget = 0
        super().data_received(data[:budget])
        if self._is_refused or self.transport.is_closing():
            return
        if self._header_budget is not None:
            size = self.limits.max_header_bytes
            self._refuse(431, f"The request line and headers exceed {size} bytes, the "
                         "gateway's limit (--max-header-bytes).", "header_too_large",
                         "header_too_large")  # fmt: skip
            return
        super().data_received(data[budget:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._header_budget = None
        if self._is_over_capacity:
            self._refuse(503, f"The gateway has {self.limits.max_connections} connections "
                         "open, its limit (--max-connections); retry shortly.",
                         "too_many_connections", "too_many_connections",
                         retry_after_s=CONNECTIONS_RETRY_AFTER_S)  # fmt: skip
            return
        super().on_headers_complete()
        # Cancelled by the message's end, right away for a request without a body.
        self._body_timer = self.loop.call_later(type(self).body_timeout_s, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        if not self._is_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_body_timer()
        if self._is_refused:
            return
        super().on_message_complete()
        self._header_budget = self.limits.max_header_bytes  # the next request's

    def send_400_response(self, msg: str) -> None:
        if not self._is_refused:
            super().send_400_response(msg)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self._header_timed_out)  # fmt: skip

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._header_budget is None or self._is_refused or self.transport.is_closing():
            return
        if self._header_budget == self.limits.max_header_bytes and self.cycle is not None:
            # Idle between two requests: uvicorn's keep-alive timeout closes it quietly.
            return
        self._refuse(408, f"The request's headers did not arrive within "
                     f"{self.limits.header_timeout_s:g} s (--header-timeout-s).",
                     "header_timeout", "header_timeout")  # fmt: skip

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self._is_refused or self.transport.is_closing() or cycle is None:
            return
        timeout_s = type(self).body_timeout_s
        if cycle.response_started:
            # The app answered without waiting for the body (a 401, say): nothing more can
            # be said on this connection, so it is closed.
            type(self).on_refusal("body_timeout")
            log.info(
                "closed a connection from %s: its body did not arrive within %g s "
                "(--body-timeout-s)",
                self.client,
                timeout_s,
            )
            self.transport.close()
            return
        # The handler waiting for the body sees a disconnect and ends; what it would still
        # send is dropped (uvicorn sends nothing for a disconnected cycle), so the 408
        # below is the only answer.
        cycle.disconnected = True
        cycle.message_event.set()
        message = (
            f"The request's body did not arrive within {timeout_s:g} s of its headers "
            "(--body-timeout-s)."
        )
        self._refuse(408, message, "body_timeout", "body_timeout")

    def _refuse(self, status: int, message: str, code: str, reason: str,
                retry_after_s: int | None = None) -> None:  # fmt: skip
        self._is_refused = True
        self._cancel_header_timer()
        self._cancel_body_timer()
        type(self).on_refusal(reason)
        log.info("refused a connection from %s: %s", self.client, reason)
        self.transport.write(refusal_bytes(status, message, code, retry_after_s))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer up to an EOF
        self.flow.resume_reading()
        self.loop.call_later(REFUSAL_LINGER_S, self._close_after_linger)

    def _close_after_linger(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    # -- responses ------------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client is not reading
        as fast as we write. Past write_timeout_s of that, the client is cut."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_timed_out)  # fmt: skip

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        type(self).on_refusal("write_timeout")
        log.warning("cut a connection from %s: it read nothing for %g s (--write-timeout-s)",
                    self.client, self.limits.write_timeout_s)  # fmt: skip
        # abort, not close: close would wait for the unread buffer to drain. The app sees a
        # disconnect (connection_lost), which ends the request and frees what it held.
        self.transport.abort()


def limited_protocol(
    limits: HttpLimits,
    on_refusal: Callable[[str], None],
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    fields = {
        "limits": limits,
        "body_timeout_s": body_timeout_s,
        "on_refusal": staticmethod(on_refusal),
    }
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), fields)
