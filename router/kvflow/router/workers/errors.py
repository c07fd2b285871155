"""How a worker call failed, as types: mapped from gRPC status codes once, here.

serving/ decides what each means for the request (fail over, 400, fall back to a local
prefill); nothing above this module reads a status code or an exception's text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import grpc

from kvflow.proto.pushback import pushback_s
from kvflow.router.breaker.machine import Outcome
from kvflow.router.workers.deadlines import DeadlineMiss


class WorkerError(Exception):
    """A call to a worker failed; ``detail`` is what the worker (or gRPC) said."""

    def __init__(self, worker_id: str, detail: str) -> None:
        super().__init__(f"{worker_id}: {detail}")
        self.worker_id = worker_id
        self.detail = detail


class WorkerDownError(WorkerError):
    """Gone, broken or draining (UNAVAILABLE, INTERNAL, UNKNOWN): route elsewhere."""


class RequestRejectedError(WorkerError):
    """The worker refused the request as invalid (INVALID_ARGUMENT): another worker would too."""


class WorkerTimeoutError(WorkerError):
    """No answer within the deadline (DEADLINE_EXCEEDED, or the router's own wait)."""


class WorkerStalledError(WorkerTimeoutError):
    """The stream missed its first-token or token-stall deadline (workers/deadlines.py); the
    call was cancelled, which aborts the request on the worker."""

    def __init__(self, worker_id: str, miss: DeadlineMiss) -> None:
        super().__init__(worker_id, miss.describe())
        self.miss = miss


class WorkerBusyError(WorkerError):
    """The worker's queue is full (RESOURCE_EXHAUSTED): healthy, so not marked down; try
    another. ``retry_after_s`` is its own estimate of when it will take requests again
    (gRFC A6's ``grpc-retry-pushback-ms`` trailer), None when it sent none."""

    def __init__(self, worker_id: str, detail: str, retry_after_s: float | None) -> None:
        super().__init__(worker_id, detail)
        self.retry_after_s = retry_after_s


class WorkerCallError(WorkerError):
    """Anything else: aborted, out of resources, a stream that ended without finishing."""


_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.UNKNOWN})  # fmt: skip


def _pushback_s(exc: grpc.aio.AioRpcError) -> float | None:
    # At run time grpc.aio.Metadata, iterated as (key, value) pairs; the stubs disagree.
    return pushback_s(cast("Iterable[tuple[str, str | bytes]]", exc.trailing_metadata() or ()))
    return None


# What a gRPC call can raise: a status from the worker, or a call on a channel the pool has
# already closed (the worker left the pool while a request was being placed on it).
GRPC_CALL_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError)


def from_grpc_error(worker_id: str, exc: Exception) -> WorkerError:
    """The typed error for one of GRPC_CALL_ERRORS."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return WorkerDownError(worker_id, f"the worker left the pool ({exc})")
    code = exc.code()
    detail = f"{code.name}: {exc.details()}"
    if code in _DOWN_CODES:
        return WorkerDownError(worker_id, detail)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RequestRejectedError(worker_id, detail)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return WorkerTimeoutError(worker_id, detail)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerBusyError(worker_id, detail, _pushback_s(exc))
    return WorkerCallError(worker_id, detail)


def breaker_outcome(exc: BaseException) -> Outcome | None:
    """What a failed call says about its worker, for its circuit breaker; None: nothing
    (refused as invalid: any worker would; full: busy is not broken; cancelled: the client
    left; anything else: ours, not the worker's)."""
    if isinstance(exc, WorkerStalledError):
        return Outcome.STALL
    if isinstance(exc, WorkerTimeoutError):
        return Outcome.TIMEOUT
    if isinstance(exc, WorkerDownError | WorkerCallError):
        return Outcome.ERROR
    return None
