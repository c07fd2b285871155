"""Run a request's choices on workers: route, fail over, stream decoded text back.

Each choice runs as its own task (n > 1, or several prompts) and they merge into one
stream. A worker that fails before its first message is dropped from that choice's
candidates and the next-best worker gets it; one that fails after the client saw text ends
the stream with an error (a buffered, non-streaming choice starts over instead). Leaving
the stream early (client gone, stop string) cancels the gRPC call, which aborts the
request on the worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import (
    ApiError,
    invalid_request,
    no_worker_available,
    worker_failed,
)
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.routing.block_hasher import CachedBlockHasher
from kvflow.router.routing.pipeline import RoutingPipeline
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId
from kvflow.router.serving.decoder import ChoiceDecoder
from kvflow.router.serving.public_prefix import PublicPrefixes
from kvflow.router.serving.types import Caller, ChoiceSpec, ChoiceUsage, RequestTrace
from kvflow.router.text.tokenizer import TextTokenizer
from kvflow.router.workers.client import WorkerClient
from kvflow.router.workers.pool import WorkerPool

log = logging.getLogger("kvflow.router.serving")

# Three workers failing one request in a row means a wider problem; say so (503) rather
# than walk the whole pool while the client waits.
MAX_ATTEMPTS = 3
# After a stop string, how long to wait for the worker's final message (for usage).
ABORT_DRAIN_TIMEOUT_S = 2.0
_FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
# Failures that say the worker is gone or broken, not just busy: stop routing there.
_WORKER_DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}


class _Attempt(Exception):  # noqa: N818 - control flow, never escapes this module
    """This worker failed before the client saw anything: try the next one."""


_DONE = object()


class GenerationService:
    def __init__(
        self,
        pool: WorkerPool,
        pipeline: RoutingPipeline,
        sessions: SessionTable,
        tokenizer: TextTokenizer,
        public_prefixes: PublicPrefixes,
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._pipeline = pipeline
        self._sessions = sessions
        self._tokenizer = tokenizer
        self._public = public_prefixes
        self._metrics = metrics
        self._hasher = CachedBlockHasher()

    def model_info(self, model: str) -> pb.WorkerInfo:
        """A healthy worker's facts for ``model``, or a 503 when none is up."""
        info = self._pool.model_info(model)
        if info is None:
            raise no_worker_available(
                f"No healthy worker serves '{model}' right now "
                f"({self._pool.num_healthy()} of {len(self._pool)} workers healthy); retry shortly."
            )
        return info

    async def run(
        self, caller: Caller, specs: Sequence[ChoiceSpec], trace: RequestTrace, *, buffered: bool
    ) -> AsyncGenerator[ChoiceDelta | ChoiceUsage]:
        """Every choice's deltas, interleaved, then each choice's usage. Raises ApiError."""
        queue: asyncio.Queue[object] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._choice_task(caller, spec, trace, queue, buffered))
            for spec in specs
        ]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, ChoiceDelta | ChoiceUsage)
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice_task(
        self,
        caller: Caller,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        buffered: bool,
    ) -> None:
        try:
            await self._run_choice(caller, spec, trace, queue, buffered)
        except ApiError as exc:
            queue.put_nowait(exc)
        except Exception as exc:  # a bug: surface it to the request as a 500, and log it
            log.exception("choice %d failed", spec.index)
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_DONE)

    async def _run_choice(
        self,
        caller: Caller,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        buffered: bool,
    ) -> None:
        info = self.model_info(caller.model)
        tokens = spec.prompt_token_ids
        salt = caller.tenant.cache_salt
        num_public = self._public.num_public_blocks(tokens, info.block_size)
        excluded: set[WorkerId] = set()
        last_failure = ""
        for _ in range(MAX_ATTEMPTS):
            started_s = time.perf_counter()
            hashes = self._hasher.iter_hashes(
                tokens,
                block_size=info.block_size,
                seed=info.hash_seed,
                salt=salt,
                num_public_blocks=num_public,
            )
            route_request = RouteRequest(
                caller.model, hashes, caller.session_id, excluded=frozenset(excluded)
            )
            decision = self._pipeline.route(route_request, self._pool.views())
            self._metrics.decision_s.observe(time.perf_counter() - started_s)
            if decision is None:
                break
            trace.routes.append(f"choice={spec.index}; {decision.header_value()}")
            request = pb.GenerateRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=tokens,
                sampling=spec.sampling,
                cache_salt=salt,
                priority=caller.tenant.priority,
                num_public_blocks=num_public,
            )
            worker_id = decision.worker_id
            try:
                with self._pool.request_open(worker_id):
                    sink: list[object] | None = [] if buffered else None
                    await self._stream(
                        self._pool.client(worker_id), request, spec, trace, queue, sink
                    )
                    for item in sink or ():
                        queue.put_nowait(item)
            except _Attempt as exc:
                last_failure = f"{worker_id}: {exc}"
                log.warning("failing over from %s: %s", worker_id, exc)
                excluded.add(worker_id)
                self._metrics.failovers.inc()
                continue
            self._metrics.matched_blocks.inc(decision.scores.get("prefix_blocks", 0.0))
            if caller.session_id:
                self._sessions.set(caller.session_id, worker_id)
            return
        raise no_worker_available(
            f"No worker could take this request for '{caller.model}'"
            + (f"; the last failure was {last_failure}" if last_failure else "")
            + "; retry shortly."
        )

    def _failed_before_output(self, worker_id: str, exc: grpc.aio.AioRpcError) -> _Attempt:
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise invalid_request(f"The worker refused the request: {exc.details()}")
        if code in _WORKER_DOWN_CODES:
            self._pool.mark_failed(WorkerId(worker_id), f"{code.name}: {exc.details()}")
        return _Attempt(f"{code.name}: {exc.details()}")

    async def _stream(
        self,
        client: WorkerClient,
        request: pb.GenerateRequest,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        sink: list[object] | None,
    ) -> None:
        """Stream one attempt. Raises _Attempt while a retry is still invisible to the client."""
        sampling = spec.sampling
        decoder = ChoiceDecoder(
            spec.index,
            self._tokenizer,
            spec.stop_strings,
            with_logprobs=sampling.logprobs,
            num_top_logprobs=spec.num_top_logprobs,
        )
        emit = sink.append if sink is not None else queue.put_nowait
        has_output = False
        call = client.generate(request)
        messages = aiter(call)
        try:
            while True:
                try:
                    message = await anext(messages, None)
                except grpc.aio.AioRpcError as exc:
                    if not has_output or sink is not None:
                        raise self._failed_before_output(client.address, exc) from exc
                    raise worker_failed(
                        f"The worker failed mid-stream ({exc.code().name}: {exc.details()})"
                    ) from exc
                if message is None:
                    if not has_output or sink is not None:
                        raise _Attempt("the stream ended without a final message")
                    raise worker_failed("The worker ended the stream without finishing.")
                if trace.first_token_s is None:
                    trace.first_token_s = time.perf_counter()
                    self._metrics.ttft_s.observe(trace.first_token_s - trace.arrival_s)
                has_output = True
                delta = decoder.feed(message.token_ids, message.logprobs)
                if decoder.is_stopped:
                    if delta is not None:
                        emit(delta)
                    emit(decoder.finish("stop"))
                    final = await self._abort_and_drain(client, messages, request.request_id)
                    emit(self._usage(spec, final, decoder.num_tokens))
                    return
                if message.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                    if delta is not None:
                        emit(delta)
                    continue
                if message.finish_reason == pb.FINISH_REASON_ABORT:
                    raise worker_failed("The worker aborted the request.")
                if delta is not None:
                    emit(delta)
                emit(decoder.finish(_FINISH_REASONS[message.finish_reason]))
                emit(self._usage(spec, message, decoder.num_tokens))
                return
        finally:
            call.cancel()  # no-op when finished; aborts the worker's request otherwise

    async def _abort_and_drain(
        self,
        client: WorkerClient,
        messages: AsyncIterator[pb.GenerateResponse],
        request_id: str,
    ) -> pb.GenerateResponse | None:
        """Abort on the worker and wait briefly for its final message, which has the usage."""
        try:
            await client.abort(request_id, ABORT_DRAIN_TIMEOUT_S)
            async with asyncio.timeout(ABORT_DRAIN_TIMEOUT_S):
                async for message in messages:
                    if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return message
                return None
        except (grpc.aio.AioRpcError, TimeoutError):
            return None  # the caller estimates usage; the finally cancels the call

    def _usage(
        self, spec: ChoiceSpec, final: pb.GenerateResponse | None, num_tokens: int
    ) -> ChoiceUsage:
        if final is None or not final.HasField("usage"):
            usage = UsageCounts(len(spec.prompt_token_ids), num_tokens, 0)
        else:
            u = final.usage
            usage = UsageCounts(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        return ChoiceUsage(spec.index, spec.prompt_index, usage)
