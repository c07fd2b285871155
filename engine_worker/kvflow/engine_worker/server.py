"""The worker's gRPC service: protobuf in and out, engine errors mapped to status codes once."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import Message

from kvflow.engine_worker import tracing
from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.core.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
)
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    PeerUnreachableError,
    SendTarget,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.loop_records import KvReservationOut, KvSnapshot
from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.engine_worker.wire_context import priority_class, request_context
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # llguidance and torch load only in workers that run a model
    from kvflow.engine_worker.structured.service import StructuredOutputs

Context = grpc.aio.ServicerContext[Any, Any]

# Fault injection for tests only: publish evictions with no block hashes, so that
# subscribers (the router's index) go on believing this worker holds blocks it evicted,
# as they would while events are lost or late. Never set in production.
_FAULT_HIDE_REMOVALS = os.environ.get("KVFLOW_FAULT_HIDE_KV_REMOVALS") == "1"
# Fault injection for tests only: after this many token messages of a Generate stream, stop
# sending for KVFLOW_FAULT_STREAM_PAUSE_S while the engine runs on: a worker that stalls
# mid-stream, as the router sees it (its token-stall deadline). Never set in production.
_FAULT_STREAM_PAUSE_AFTER = int(os.environ.get("KVFLOW_FAULT_STREAM_PAUSE_AFTER", "0"))
_FAULT_STREAM_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_STREAM_PAUSE_S", "0"))
# Fault injection for tests only: while the file this names exists, each Generate call reads
# it first: a gRPC status name (INTERNAL, ABORTED, ...) fails the call with that status
# before any token; "stall" holds the call, sending nothing, until the file is gone. Health
# and Load answer as usual, so a test removes the file to make the worker recover, without
# a restart. Never set in production.
_FAULT_GENERATE_FILE = os.environ.get("KVFLOW_FAULT_GENERATE_FILE", "")


async def _generate_fault(context: Context) -> None:
    try:
        fault = Path(_FAULT_GENERATE_FILE).read_text().strip()
    except FileNotFoundError:
        return
    if fault == "stall":
        while Path(_FAULT_GENERATE_FILE).exists():
            await asyncio.sleep(0.05)
        return
    await context.abort(grpc.StatusCode[fault], "fault injected (KVFLOW_FAULT_GENERATE_FILE)")


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
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
    )


_TRANSFER_ERROR_CODES: dict[type[KvTransferError], grpc.StatusCode] = {
    PeerUnreachableError: grpc.StatusCode.UNAVAILABLE,
    TransferTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    TransferCancelledError: grpc.StatusCode.CANCELLED,
    TransferRejectedError: grpc.StatusCode.ABORTED,
}


def reservation_to_proto(
    r: KvReservationOut, *, instance_id: str, kv_layout: str
) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=r.request_id)
    res = msg.kv_reservation
    res.version = pb.KV_HANDOFF_VERSION_1
    res.decode_instance_id = instance_id
    res.first_token = r.first_token
    res.end_token = r.end_token
    res.kv_layout = kv_layout
    if r.ticket is not None:
        res.transfer_id = r.ticket.transfer_id
        res.transport = r.ticket.kind.to_pb()
        res.endpoint = r.ticket.endpoint
        res.tag = r.ticket.tag
        res.deadline_s = r.ticket.timeout_s
    return msg


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
        msg.usage.remote_tokens = out.num_remote_tokens
        if out.timings is not None:
            msg.timings.queued_s = out.timings.queued_s
            msg.timings.ttft_s = out.timings.ttft_s
            msg.timings.e2e_s = out.timings.e2e_s
            msg.timings.num_preemptions = out.timings.num_preemptions
    return msg


# One request broke inside the worker (engine_loop's _fail): ABORTED, not INTERNAL or
# UNKNOWN, which a router reads as the worker being down; the worker serves on. A
# duplicate request id is an InvalidRequestError (INVALID_ARGUMENT: the caller's bug).
_REQUEST_FAILED = grpc.StatusCode.ABORTED

# gRFC A6's server pushback: milliseconds until the caller should try this worker again.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


async def _abort_queue_full(context: Context, exc: QueueFullError) -> None:
    """RESOURCE_EXHAUSTED, not UNAVAILABLE: the worker is healthy, only busy, and the router
    must not mark it down (it fails the request over, or answers 503 with Retry-After)."""
    pushback_ms = str(round(exc.retry_after_s * 1000))
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        str(exc),
        trailing_metadata=((RETRY_PUSHBACK_KEY, pushback_ms),),
    )


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        loop: EngineLoop,
        info: pb.WorkerInfo,
        kv_layout: str = "",
        structured: StructuredOutputs | None = None,  # None: a simulated worker
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.loop = loop
        self.info = info
        self.kv_layout = kv_layout
        self.structured = structured
        self.metrics = metrics

    async def _refuse_busy(self, context: Context, exc: QueueFullError) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(exc.reason).inc()
        await _abort_queue_full(context, exc)

    async def _constrained(
        self, sampling: SamplingParams, message: pb.StructuredOutput
    ) -> SamplingParams:
        """``sampling`` with the grammar's processor; compiled in a thread, off the
        engine thread (docs/router.md, "Structured output")."""
        if self.structured is None:
            raise InvalidRequestError(
                "this worker simulates a model (--simulate) and cannot constrain output to "
                "a format; send structured output to a worker that runs a model"
            )
        processor = await asyncio.to_thread(self.structured.processor, message)
        return dataclasses.replace(sampling, logits_processor=processor)

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
        if _FAULT_GENERATE_FILE:
            await _generate_fault(context)
        remote_kv_timeout_s = None
        if request.HasField("remote_prefill"):
            if request.remote_prefill.version != pb.KV_HANDOFF_VERSION_1:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"KV handoff version {request.remote_prefill.version} is not supported "
                    "(this worker speaks 1); upgrade the router or the worker",
                )
            remote_kv_timeout_s = request.remote_prefill.timeout_s
        trace_parent = tracing.parent_from(context)  # None unless tracing is on and asked
        try:
            ctx = request_context(request)
            sampling = sampling_from_proto(request.sampling)
            if request.HasField("structured_output"):
                sampling = await self._constrained(sampling, request.structured_output)
            stream = self.loop.generate(
                request.request_id,
                list(request.prompt_token_ids),
                sampling,
                cache_salt=ctx.cache_salt,
                num_public_blocks=ctx.num_public_blocks,
                priority=ctx.priority,
                tenant=ctx.tenant or None,
                remote_kv_timeout_s=remote_kv_timeout_s,
                priority_class=priority_class(ctx),
            )
            # A client that goes away closes this handler at a yield: close the engine's
            # stream right then, which aborts the request and frees its blocks.
            async with contextlib.aclosing(stream):
                num_sent = 0
                async for out in stream:
                    if isinstance(out, KvReservationOut):
                        yield reservation_to_proto(
                            out, instance_id=self.info.instance_id, kv_layout=self.kv_layout
                        )
                    else:
                        message = output_to_proto(out)
                        if trace_parent is not None and out.finish_reason is not None:
                            tracing.record_generate(trace_parent, request, message, self.info)
                        yield message
                        num_sent += 1
                        if num_sent == _FAULT_STREAM_PAUSE_AFTER:
                            await asyncio.sleep(_FAULT_STREAM_PAUSE_S)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            await self._refuse_busy(context, exc)
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RequestFailedError as exc:
            await context.abort(_REQUEST_FAILED, str(exc))

    async def Prefill(  # noqa: N802
        self, request: pb.PrefillRequest, context: Context
    ) -> pb.PrefillResponse:
        dest = request.destination
        problem = self._destination_problem(dest)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        target = SendTarget(dest.transfer_id, dest.endpoint, dest.tag, dest.decode_instance_id)
        ctx = request_context(request)
        try:
            result = await self.loop.prefill(
                request.request_id,
                list(request.prompt_token_ids),
                target,
                first_token=dest.first_token,
                end_token=dest.end_token,
                timeout_s=dest.deadline_s,
                cache_salt=ctx.cache_salt,
                num_public_blocks=ctx.num_public_blocks,
                priority=ctx.priority,
                tenant=ctx.tenant or None,
                priority_class=priority_class(ctx),
            )
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            await self._refuse_busy(context, exc)
        except EngineOverloadedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except RequestFailedError as exc:
            await context.abort(_REQUEST_FAILED, str(exc))
        except KvTransferError as exc:
            code = _TRANSFER_ERROR_CODES.get(type(exc), grpc.StatusCode.ABORTED)
            await context.abort(code, f"sending KV to {dest.endpoint} failed: {exc}")
        out = result.output
        timings = out.timings
        response = pb.PrefillResponse(
            num_computed_tokens=out.num_prompt_tokens - out.num_cached_tokens,
            num_cached_tokens=out.num_cached_tokens,
            num_sent_blocks=result.num_sent_blocks,
            num_sent_bytes=result.send.num_bytes,
            queued_s=timings.queued_s if timings else 0.0,
            prefill_s=(timings.e2e_s - result.send.transfer_s) if timings else 0.0,
            transfer_s=result.send.transfer_s,
        )
        trace_parent = tracing.parent_from(context)
        if trace_parent is not None:
            tracing.record_prefill(trace_parent, request, response, self.info)
        return response

    def _destination_problem(self, dest: pb.KvReservation) -> str:
        """Why this worker cannot serve a reservation, or "" (a config bug, never retried)."""
        if dest.version != pb.KV_HANDOFF_VERSION_1:
            return f"KV handoff version {dest.version} is not supported (this worker speaks 1)"
        if dest.transport != self.info.kv_transport:
            return (
                f"the decode worker expects KV over {pb.KvTransport.Name(dest.transport)} but "
                f"this worker sends over {pb.KvTransport.Name(self.info.kv_transport)}; give "
                "every worker of a pool the same --kv-transport"
            )
        if dest.kv_layout != self.kv_layout:
            shape, _, theirs = dest.kv_layout.rpartition("/")
            our_shape, _, ours = self.kv_layout.rpartition("/")
            if shape == our_shape:  # the same model and blocks; the KV dtype (the last field)
                return (
                    f"KV dtypes differ: decode stores {theirs!r}, this worker {ours!r} "
                    f"(layouts {dest.kv_layout!r}, {self.kv_layout!r}); give every worker of "
                    "a pool the same --kv-cache-dtype and --dtype"
                )
            return (
                f"KV layouts differ: decode {dest.kv_layout!r}, this worker {self.kv_layout!r}; "
                "prefill and decode workers must serve the same model, dtype, KV cache dtype "
                "and block size"
            )
        if not dest.transfer_id or not dest.endpoint:
            return "the destination names no transfer: nothing to send"
        return ""

    async def CancelKvTransfer(  # noqa: N802
        self, request: pb.CancelKvTransferRequest, context: Context
    ) -> pb.CancelKvTransferResponse:
        return pb.CancelKvTransferResponse(found=self.loop.cancel_kv_transfer(request.request_id))

    async def Embed(  # noqa: N802
        self, request: pb.EmbedRequest, context: Context
    ) -> pb.EmbedResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"this worker generates ({self.info.model}) and does not embed; send embeddings "
            "to a worker started with --task embed",
        )
        raise AssertionError("unreachable")  # abort raises

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: Context
    ) -> pb.AbortResponse:
        found = request.request_id in self.loop.engine.requests
        self.loop.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: Context
    ) -> pb.HealthResponse:
        # Not serving while draining or while the engine thread is stopped or stuck (the
        # router then stops sending here; liveness.py).
        is_serving = not self.loop.is_draining and self.loop.heartbeat.problem() is None
        return pb.HealthResponse(is_serving=is_serving, info=self.info)

    async def Load(  # noqa: N802
        self, request: pb.LoadRequest, context: Context
    ) -> pb.LoadResponse:
        load = self.loop.load
        queue = self.loop.engine.queue_stats  # replaced whole by the engine thread
        return pb.LoadResponse(
            max_waiting_requests=queue.max_waiting_requests or 0,
            queue_drain_rate_per_s=queue.drain_rate_per_s,
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            kv_usage=load.kv_usage,
            num_cached_blocks=load.num_cached_blocks,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            num_kv_transfers=load.num_kv_transfers,
            num_prefill_tokens=load.num_prefill_tokens,
            num_decode_seqs=load.num_decode_seqs,
            num_kv_tokens=load.num_kv_tokens,
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
                    hidden = _FAULT_HIDE_REMOVALS and event.kind is KvEventKind.REMOVED
                    batch.events.add(
                        seq=event.seq,
                        kind=event.kind.value,
                        block_hashes=() if hidden else event.block_hashes,
                    )
                yield batch
        finally:
            self.loop.unsubscribe(sub)
