"""The worker's gRPC service: each RPC of kvflow.worker.v1, from the request's protobuf to
the engine loop and back.

The pieces it calls at its edge live beside it, one idea each: ``wire_checks`` (what it
refuses as sent), ``wire_convert`` (protobuf to the engine's records and back),
``error_status`` (engine and transfer errors to status codes, mapped once) and
``service_faults`` (test-only fault hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from kvflow.engine_worker import service_faults, tracing
from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.error_status import (
    ENGINE_ERRORS,
    Context,
    abort_for_engine_error,
    abort_for_transfer_error,
)
from kvflow.engine_worker.kv_transfer.base import KvTransferError, SendTarget
from kvflow.engine_worker.loop_records import KvReservationOut, KvSnapshot
from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.engine_worker.wire_checks import destination_problem, unknown_field_numbers
from kvflow.engine_worker.wire_context import priority_class, request_context
from kvflow.engine_worker.wire_convert import (
    output_to_proto,
    reservation_to_proto,
    sampling_from_proto,
)
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.stack import LargeStackThreadPool

if TYPE_CHECKING:  # llguidance and torch load only in workers that run a model
    from kvflow.engine_worker.structured.service import StructuredOutputs


# Structured output's grammars compile here, off the engine thread, on a large stack: the
# compiler recurses per reference in native code and overflowed the default one (a flat
# 50-90 KB chain of `$ref`s killed the process; proto/stack.py). Four at once: compiled
# grammars are cached, and a burst of new ones waits here, never on the engine.
_COMPILE_POOL = LargeStackThreadPool(max_workers=4, thread_name_prefix="kvflow-compile")


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
        loop = asyncio.get_running_loop()
        processor = await loop.run_in_executor(_COMPILE_POOL, self.structured.processor, message)
        return dataclasses.replace(sampling, logits_processor=processor)

    async def Generate(  # noqa: N802 (gRPC method names)
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        unknown = unknown_field_numbers(request)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown fields {unknown} in the request: this worker speaks "
                "kvflow.worker.v1 and does not understand them; upgrade the worker",
            )
        if service_faults.GENERATE_FILE:
            await service_faults.generate_fault(context)
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
                        if num_sent == service_faults.STREAM_PAUSE_AFTER:
                            await asyncio.sleep(service_faults.STREAM_PAUSE_S)
        except ENGINE_ERRORS as exc:
            await abort_for_engine_error(context, exc, self.metrics)

    async def Prefill(  # noqa: N802
        self, request: pb.PrefillRequest, context: Context
    ) -> pb.PrefillResponse:
        dest = request.destination
        problem = destination_problem(
            dest, kv_transport=self.info.kv_transport, kv_layout=self.kv_layout
        )
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
        except ENGINE_ERRORS as exc:
            await abort_for_engine_error(context, exc, self.metrics)
        except KvTransferError as exc:
            await abort_for_transfer_error(context, exc, dest.endpoint)
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
                    hidden = service_faults.HIDE_KV_REMOVALS and event.kind is KvEventKind.REMOVED
                    batch.events.add(
                        seq=event.seq,
                        kind=event.kind.value,
                        block_hashes=() if hidden else event.block_hashes,
                    )
                yield batch
        finally:
            self.loop.unsubscribe(sub)
