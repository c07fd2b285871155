"""A worker's full queue, as the router types it: busy (not down), with the worker's own
back-off from gRFC A6's pushback trailer, which becomes the 503's Retry-After."""

from __future__ import annotations

import grpc

from kvflow.router.workers.errors import WorkerBusyError, WorkerCallError, from_grpc_error


def rpc_error(code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...]) -> Exception:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details="queue is full"
    )


def test_resource_exhausted_is_busy_with_the_workers_pushback() -> None:
    exc = from_grpc_error("w1", rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          (("grpc-retry-pushback-ms", "4500"),)))  # fmt: skip
    assert isinstance(exc, WorkerBusyError) and exc.retry_after_s == 4.5
    assert "RESOURCE_EXHAUSTED: queue is full" in exc.detail


def test_a_missing_or_garbled_pushback_is_no_hint() -> None:
    for trailers in ((), (("grpc-retry-pushback-ms", "soon"),)):
        exc = from_grpc_error("w1", rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, trailers))
        assert isinstance(exc, WorkerBusyError) and exc.retry_after_s is None
    other = from_grpc_error("w1", rpc_error(grpc.StatusCode.ABORTED, ()))
    assert type(other) is WorkerCallError
