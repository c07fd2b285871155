"""A gRPC client for one worker (kvflow.worker.v1), over one long-lived channel."""

from __future__ import annotations

from typing import Any

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

# A snapshot of 2**18 cached blocks is about 2.4 MB; 64 MiB leaves room for any worker.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    # A worker that vanishes without closing its socket (a node lost) is noticed in ~15 s
    # instead of the kernel's TCP timeout of minutes; a killed process resets at once.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # We fail over ourselves, to a different worker; gRPC's own retries would hide failures.
    ("grpc.enable_retries", 0),
]

GenerateCall = grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]
KvEventsCall = grpc.aio.UnaryStreamCall[pb.SubscribeKvEventsRequest, pb.KvEventBatch]


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub: Any = pb_grpc.WorkerStub(self._channel)

    async def health(self, timeout_s: float) -> pb.HealthResponse:
        response: pb.HealthResponse = await self._stub.Health(pb.HealthRequest(), timeout=timeout_s)
        return response

    async def load(self, timeout_s: float) -> pb.LoadResponse:
        response: pb.LoadResponse = await self._stub.Load(pb.LoadRequest(), timeout=timeout_s)
        return response

    def generate(self, request: pb.GenerateRequest) -> GenerateCall:
        """The response stream; cancelling it aborts the request on the worker."""
        call: GenerateCall = self._stub.Generate(request)
        return call

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        response: pb.AbortResponse = await self._stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=timeout_s
        )
        return response.found

    def subscribe_kv_events(self) -> KvEventsCall:
        call: KvEventsCall = self._stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest())
        return call

    async def close(self) -> None:
        await self._channel.close(grace=None)
