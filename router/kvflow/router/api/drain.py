"""Draining on SIGTERM: /ready turns 503 at once, new API requests get a 503 with
Retry-After, the running ones (streams included) finish, up to a grace period; then the
server stops (api/server.py).

`DrainState` is the pure part (times passed in); `DrainMiddleware` the ASGI shell that
counts requests in flight and turns new ones away.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvflow.router.protocol.errors import ApiError

# 25 s: the operator's router pods get 30 s between SIGTERM (after their preStop sleep)
# and SIGKILL; 25 s to finish streams leaves 5 s to close connections and the pool.
DEFAULT_DRAIN_GRACE_S = 25.0
# A draining replica's answer to new requests: another replica (or this one's successor)
# can take them at once, so a client need not back off longer.
DRAINING_RETRY_AFTER_S = 1.0


class DrainState:
    """Requests in flight, and whether (since when) this router drains."""

    __slots__ = ("draining_since_s", "grace_s", "num_in_flight")

    def __init__(self, grace_s: float = DEFAULT_DRAIN_GRACE_S) -> None:
        assert grace_s >= 0, grace_s
        self.grace_s = grace_s
        self.num_in_flight = 0
        self.draining_since_s: float | None = None

    @property
    def is_draining(self) -> bool:
        return self.draining_since_s is not None

    def begin(self, now_s: float) -> bool:
        """Start draining; False if it already had."""
        if self.draining_since_s is not None:
            return False
        self.draining_since_s = now_s
        return True

    def is_done(self, now_s: float) -> bool:
        """Draining, and nothing is left to wait for: no request runs, or the grace is over."""
        if self.draining_since_s is None:
            return False
        return self.num_in_flight == 0 or now_s >= self.draining_since_s + self.grace_s


def draining_error() -> ApiError:
    return ApiError(
        503,
        "This gateway replica is shutting down and takes no new requests; retry, and the "
        "request goes to another replica.",
        type="server_error",
        code="service_unavailable",
        retry_after_s=DRAINING_RETRY_AFTER_S,
    )


class DrainMiddleware:
    """Counts API requests (paths under ``prefix``) while they run, a stream until its last
    byte; while draining, answers new ones with a 503 and closes the connection, so a
    keep-alive client reconnects (to another replica). /health, /ready, /metrics still
    answer."""

    def __init__(self, app: ASGIApp, state: DrainState, prefix: str = "/v1/") -> None:
        self.app = app
        self.state = state
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        state = self.state
        if state.is_draining:
            exc = draining_error()
            headers = {**exc.headers(), "connection": "close"}
            await JSONResponse(exc.body(), exc.status, headers)(scope, receive, send)
            return
        state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.num_in_flight -= 1
