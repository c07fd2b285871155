"""Worker gRPC authentication: a shared bearer token per pool.

Worker gRPC is where prompts go in, KV events come out and anyone's request can be
aborted, so when ``KVFLOW_WORKER_TOKEN`` is set the worker refuses every call that does
not carry ``authorization: Bearer <that token>`` (UNAUTHENTICATED, before the handler
runs). Routers send it from the same variable. The comparison is constant-time. Unset, the
worker is open, as before (a laptop, a test): say so in the log.

The token authenticates callers, it does not encrypt: on an untrusted network put the
pool's traffic on a mesh with mTLS. On the KV port the tcp transport proves the same
token both ways and MACs every payload byte (kv_transfer/tcp_auth.py); the gloo and nccl
transports sign their rendezvous keys and prove it both ways on each new pair group before
it carries KV (kv_transfer/group_auth.py). Their rendezvous store has no authentication of
its own; the pool's NetworkPolicy limits it to the pool's pods.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

TOKEN_ENV = "KVFLOW_WORKER_TOKEN"

if TYPE_CHECKING:  # generic only in the stubs
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def is_authorized(metadata: tuple[tuple[str, str | bytes], ...] | None, token: str) -> bool:
    """Pure: whether call metadata carries the bearer token."""
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == "authorization":
            given = value if isinstance(value, bytes) else value.encode()
            if hmac.compare_digest(given, expected):
                return True
    return False


class TokenInterceptor(_Interceptor):
    def __init__(self, token: str) -> None:
        self._token = token

        async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"this worker needs 'authorization: Bearer <token>' ({TOKEN_ENV})",
            )

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await refuse(request, context)
            yield  # pragma: no cover - abort raises

        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse_stream)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        if is_authorized(handler_call_details.invocation_metadata, self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._refuse_stream
        return self._refuse_unary
