"""The engine's and the KV transfer's errors as gRPC status codes, mapped once for every RPC.

A router acts on the code alone: INVALID_ARGUMENT is the caller's bug and never retried,
RESOURCE_EXHAUSTED a busy but healthy worker (with when to try again), UNAVAILABLE a worker
that cannot serve now, and ABORTED one request that broke while the worker serves on. Kept
apart from the service so that every RPC answers an error the same way.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from kvflow.engine_worker.core.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
)
from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    PeerUnreachableError,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.proto.pushback import pushback_metadata

Context = grpc.aio.ServicerContext[Any, Any]

# The engine's errors that end a request before or while it runs: abort_for_engine_error
# answers each.
ENGINE_ERRORS = (InvalidRequestError, QueueFullError, EngineOverloadedError, RequestFailedError)

_TRANSFER_ERROR_CODES: dict[type[KvTransferError], grpc.StatusCode] = {
    PeerUnreachableError: grpc.StatusCode.UNAVAILABLE,
    TransferTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferCancelledError: grpc.StatusCode.CANCELLED,
    TransferRejectedError: grpc.StatusCode.ABORTED,
}

# One request broke inside the worker (engine_loop's _fail): ABORTED, not INTERNAL or
# UNKNOWN, which a router reads as the worker being down; the worker serves on. A
# duplicate request id is an InvalidRequestError (INVALID_ARGUMENT: the caller's bug).
_REQUEST_FAILED = grpc.StatusCode.ABORTED


async def _abort_queue_full(context: Context, exc: QueueFullError) -> NoReturn:
    """RESOURCE_EXHAUSTED, not UNAVAILABLE: the worker is healthy, only busy, and the router
    must not mark it down (it fails the request over, or answers 503 with Retry-After)."""
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        str(exc),
        trailing_metadata=pushback_metadata(exc.retry_after_s),  # gRFC A6
    )


async def abort_for_engine_error(
    context: Context,
    exc: InvalidRequestError | EngineOverloadedError | RequestFailedError,
    metrics: WorkerMetrics | None,
) -> NoReturn:
    """End the call with ``exc``'s status; a refusal for a full queue is counted."""
    if isinstance(exc, InvalidRequestError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    elif isinstance(exc, QueueFullError):
        if metrics is not None:
            metrics.rejected.labels(exc.reason).inc()
        await _abort_queue_full(context, exc)
    elif isinstance(exc, EngineOverloadedError):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    else:
        await context.abort(_REQUEST_FAILED, str(exc))


async def abort_for_transfer_error(
    context: Context, exc: KvTransferError, endpoint: str
) -> NoReturn:
    """End a prefill's call after sending its KV to ``endpoint`` failed."""
    code = _TRANSFER_ERROR_CODES.get(type(exc), grpc.StatusCode.ABORTED)
    await context.abort(code, f"sending KV to {endpoint} failed: {exc}")
