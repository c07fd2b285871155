"""The worker's gRPC service: protobuf in and out, engine errors mapped to status codes once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import Message

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.core.errors import EngineOverloadedError, InvalidRequestError
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.engine_loop import EngineLoop, KvSnapshot
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext[Any, Any]

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def _unknown_field_numbers(message: Message) -> list[int]:
    """Field numbers this worker does not understand, in the message and its sampling."""
    messages = [message]
    if isinstance(message, pb.GenerateRequest) and message.HasField("sampling"):
        messages.append(message.sampling)
    numbers: list[int] = []
    for m in messages:
        unknown = unknown_fields.UnknownFieldSet(m)
        numbers += [unknown[i].field_number for i in range(len(unknown))]
    return numbers


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
    )


def output_to_proto(out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id)
    msg.token_ids.extend(t.token_id for t in out.new_tokens)
    for t in out.new_tokens:
        if t.logprob is not None:
            msg.logprobs.add(
                logprob=t.logprob, top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs
            )
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_tokens = out.num_cached_tokens
        if out.timings is not None:
            msg.timings.queued_s = out.timings.queued_s
            msg.timings.ttft_s = out.timings.ttft_s
            msg.timings.e2e_s = out.timings.e2e_s
            msg.timings.num_preemptions = out.timings.num_preemptions
    return msg


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, info: pb.WorkerInfo) -> None:
        self.loop = loop
        self.info = info

    async def Generate(  # noqa: N802 (gRPC method names)
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        unknown = _unknown_field_numbers(request)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown fields {unknown} in the request: this worker speaks "
                "kvflow.worker.v1 and does not understand them; upgrade the worker",
            )
        try:
            stream = self.loop.generate(
                request.request_id,
                list(request.prompt_token_ids),
                sampling_from_proto(request.sampling),
                cache_salt=request.cache_salt,
                num_public_blocks=request.num_public_blocks,
                priority=request.priority,
            )
            async for out in stream:
                yield output_to_proto(out)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: Context
    ) -> pb.AbortResponse:
        found = request.request_id in self.loop.engine.requests
        self.loop.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: Context
    ) -> pb.HealthResponse:
        return pb.HealthResponse(is_serving=not self.loop.is_draining, info=self.info)

    async def Load(  # noqa: N802
        self, request: pb.LoadRequest, context: Context
    ) -> pb.LoadResponse:
        load = self.loop.load
        return pb.LoadResponse(
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            kv_usage=load.kv_usage,
            num_cached_blocks=load.num_cached_blocks,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
        )

    async def SubscribeKvEvents(  # noqa: N802
        self, request: pb.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[pb.KvEventBatch]:
        sub = self.loop.subscribe()
        instance_id = self.info.instance_id
        try:
            while True:
                item = await sub.next()
                if isinstance(item, KvSnapshot):
                    yield pb.KvEventBatch(
                        instance_id=instance_id,
                        is_snapshot=True,
                        seq=item.seq,
                        snapshot_block_hashes=item.block_hashes,
                    )
                    continue
                batch = pb.KvEventBatch(instance_id=instance_id, seq=item[-1].seq)
                for event in item:
                    batch.events.add(
                        seq=event.seq, kind=event.kind.value, block_hashes=event.block_hashes
                    )
                yield batch
        finally:
            self.loop.unsubscribe(sub)
