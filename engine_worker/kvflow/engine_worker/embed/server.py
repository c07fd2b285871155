"""An embedding worker's gRPC service: Embed, plus the Health, Load and KV-event calls every
router probe makes. Generation calls answer UNIMPLEMENTED, naming the task to start instead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvflow.engine_worker.core.errors import InvalidRequestError, QueueFullError
from kvflow.engine_worker.embed.service import EmbedInput, EmbedService
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.pushback import pushback_metadata

Context = grpc.aio.ServicerContext[Any, Any]


def _inputs(request: pb.EmbedRequest) -> list[EmbedInput]:
    out: list[EmbedInput] = []
    for item in request.inputs:
        out.append(
            list(item.token_ids.ids) if item.WhichOneof("kind") == "token_ids" else item.text
        )
    return out


def _not_generating(model: str) -> str:
    return (
        f"this worker embeds ({model}, --task embed) and does not generate; send "
        "completions to a worker started with --task generate"
    )


class EmbedWorkerService(pb_grpc.WorkerServicer):
    def __init__(self, service: EmbedService, info: pb.WorkerInfo) -> None:
        self.service = service
        self.info = info
        self.is_draining = False

    async def Embed(  # noqa: N802 (gRPC method names)
        self, request: pb.EmbedRequest, context: Context
    ) -> pb.EmbedResponse:
        if self.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is draining")
        try:
            result = await self.service.embed(_inputs(request), request.dimensions)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                str(exc),
                trailing_metadata=pushback_metadata(exc.retry_after_s),
            )
        response = pb.EmbedResponse(
            prompt_tokens=sum(result.num_tokens),
            queued_s=result.queued_s,
            compute_s=result.compute_s,
        )
        for row, num_tokens in zip(result.vectors.tolist(), result.num_tokens, strict=True):
            response.embeddings.add(values=row, num_tokens=num_tokens)
        return response

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _not_generating(self.info.model))
        yield pb.GenerateResponse()  # pragma: no cover (abort raises)

    async def Prefill(  # noqa: N802
        self, request: pb.PrefillRequest, context: Context
    ) -> pb.PrefillResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _not_generating(self.info.model))
        raise AssertionError("unreachable")  # pragma: no cover

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: Context
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=False)

    async def CancelKvTransfer(  # noqa: N802
        self, request: pb.CancelKvTransferRequest, context: Context
    ) -> pb.CancelKvTransferResponse:
        return pb.CancelKvTransferResponse(found=False)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: Context
    ) -> pb.HealthResponse:
        return pb.HealthResponse(is_serving=not self.is_draining, info=self.info)

    async def Load(  # noqa: N802
        self, request: pb.LoadRequest, context: Context
    ) -> pb.LoadResponse:
        in_flight = self.service.num_in_flight
        running = min(in_flight, 1)
        return pb.LoadResponse(
            num_waiting=in_flight - running,
            num_running=running,
            max_waiting_requests=self.service.limits.max_waiting_requests,
        )

    async def SubscribeKvEvents(  # noqa: N802
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.KvEventBatch]:
        """No KV cache: an empty snapshot, then nothing until the subscriber leaves (routers
        follow every worker's events and restart a stream that ends)."""
        yield pb.KvEventBatch(instance_id=self.info.instance_id, is_snapshot=True, seq=0)
        await asyncio.Event().wait()
