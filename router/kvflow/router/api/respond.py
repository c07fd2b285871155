"""A running job's answer: one JSON body, or an SSE stream. Either way the accounting
settles the job exactly once however it ends (done, failed, or the client gone); one cut
short by the client, or by a worker breaking mid-stream, is charged what its workers
computed for it (api/accounting.py, charge_unsettled)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.proto.priority_class import HEADER as PRIORITY_CLASS_HEADER
from kvflow.router.api.accounting import Accounting
from kvflow.router.api.http import wait_for_disconnect
from kvflow.router.api.job_start import BUDGET_WARNING_HEADER, ROUTE_DEBUG_HEADER
from kvflow.router.api.streaming import ManagedStreamingResponse, sse_body
from kvflow.router.batch.scope import BATCH_SCOPE_KEY
from kvflow.router.caches.policy import RESULT_HEADER
from kvflow.router.caches.semantic_service import SEMANTIC_HEADER
from kvflow.router.degrade.service import DEGRADED_HEADER
from kvflow.router.protocol.responses import (
    ChoiceDelta,
    ChoiceResult,
    ChunkWriter,
    chat_completion,
    text_completion,
)
from kvflow.router.serving.job import CompletionJob
from kvflow.router.serving.types import ChoiceUsage

ItemStream = AsyncGenerator[ChoiceDelta | ChoiceUsage]

# nginx's "client closed request": nobody reads it, but logs and metrics tell it apart.
CLIENT_GONE = 499
# After a stream ends early, how long the items its workers already sent may be counted
# before the stream is closed (which aborts them): a bound, should tokens keep coming.
RECEIVED_DRAIN_S = 0.01


async def collected(
    request: Request, job: CompletionJob, stream: ItemStream, accounting: Accounting
) -> Response:
    """The whole answer as one JSON body, once every choice has ended."""
    try:
        return await _collect(request, job, stream, accounting)
    finally:
        await stream.aclose()
        await accounting.finish()


async def streamed(
    request: Request, job: CompletionJob, stream: ItemStream, accounting: Accounting
) -> Response:
    """Server-sent events, from the first item on."""
    try:
        # Errors before any output keep their HTTP status.
        first = await _first_unless_disconnected(request, stream)
    except BaseException:
        await stream.aclose()
        await accounting.finish()
        raise
    if first is None:  # the client left before the first token; the workers' calls are gone
        await stream.aclose()
        # Its first token may have come and been held back (a stop string's or a tool
        # call's prefix): the prompt was prefilled all the same.
        accounting.charge_unsettled(_prompt_tokens(job))
        accounting.is_client_gone = True
        await accounting.finish()
        return Response(status_code=CLIENT_GONE)
    parsed = job.request
    writer = ChunkWriter(
        job.response_id,
        job.created_s,
        job.served_by.served_model,
        is_chat=job.is_chat,
        with_logprobs=job.sampling.logprobs,
        include_usage=parsed.include_usage,
        continuous_usage=parsed.stream_options.continuous_usage_stats,
    )
    body_iter = sse_body(
        first, stream, writer, accounting, job.num_choices, job.is_chat, job.echo, job.sampling.n
    )

    async def close() -> None:
        await body_iter.aclose()
        # A stream that ended early (the client left, a worker broke) is charged what its
        # workers computed, the tokens received but never sent included.
        await _count_received(stream, accounting)
        await stream.aclose()
        accounting.charge_unsettled(_prompt_tokens(job))
        await accounting.finish()

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **_job_headers(job)}
    return ManagedStreamingResponse(body_iter, close, headers)


async def _first_unless_disconnected(
    request: Request, stream: ItemStream
) -> ChoiceDelta | ChoiceUsage | None:
    """The stream's first item, or None if the client leaves first. The wait can be long (a
    queued worker, a KV handoff) and nothing is sent yet that would reveal a disconnect, so
    watch for it: leaving cancels the choices, which aborts the workers' requests."""
    getter = asyncio.ensure_future(anext(stream))
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not getter.done():
            getter.cancel()
        await asyncio.gather(getter, watcher, return_exceptions=True)
    return None if getter.cancelled() else getter.result()


async def _collect(
    request: Request, job: CompletionJob, stream: ItemStream, accounting: Accounting
) -> Response:
    n = job.sampling.n
    results = [ChoiceResult(i) for i in range(job.num_choices)]
    echo = job.echo
    if echo is not None:
        for result in results:
            result.text = echo[result.index // n]

    async def consume() -> None:
        async for item in stream:
            accounting.add(item)
            if isinstance(item, ChoiceDelta):
                results[item.index].add(item)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()  # the client left: abort the workers' requests now
        await asyncio.gather(consumer, watcher, return_exceptions=True)
    if consumer.cancelled():
        accounting.is_client_gone = True
        # A batch line's "client" leaves only when this router stops, and the line runs
        # again later (batch/runner.py): charged then, not twice.
        if not request.scope.get(BATCH_SCOPE_KEY):
            # Its prompts, and the tokens each choice's buffer holds (api/accounting.py).
            accounting.charge_unsettled(_prompt_tokens(job))
        return Response(status_code=CLIENT_GONE)
    consumer.result()  # re-raises an ApiError from generation
    build = chat_completion if job.is_chat else text_completion
    body = build(
        job.response_id,
        job.created_s,
        job.served_by.served_model,
        results,
        accounting.usage,
        with_logprobs=job.sampling.logprobs,
    )
    return JSONResponse(body, headers=_job_headers(job) or None)


async def _count_received(stream: ItemStream, accounting: Accounting) -> None:
    """Add to ``accounting`` the items ``stream`` has ready at once, up to its end or its
    first wait (or RECEIVED_DRAIN_S): tokens the workers sent that the client never read.
    A wait is cut short by cancelling it, which ends the stream and its workers' calls."""
    deadline_s = time.perf_counter() + RECEIVED_DRAIN_S
    while time.perf_counter() < deadline_s:
        step = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # one turn of the loop: enough to take an item already there
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            return
        if step.cancelled() or step.exception() is not None:
            return  # its end (StopAsyncIteration), or the failure the client was told of
        accounting.add(step.result())


def _prompt_tokens(job: CompletionJob) -> list[int]:
    return [len(prompt.token_ids) for prompt in job.prompts]


def _job_headers(job: CompletionJob) -> dict[str, str]:
    # The class the request ran as: a client that asked for more than its tenant's ceiling
    # learns it was capped (protocol/priority_class.py).
    headers = {PRIORITY_CLASS_HEADER: job.tenant.priority_class.value}
    if job.wants_route:
        headers[ROUTE_DEBUG_HEADER] = job.route_header()
    if job.budget_warning is not None:
        headers[BUDGET_WARNING_HEADER] = job.budget_warning
    if job.degraded is not None:
        headers[DEGRADED_HEADER] = job.degraded
    if job.response_cache is not None:
        headers[RESULT_HEADER] = job.response_cache
    if job.semantic_cache is not None:
        headers[SEMANTIC_HEADER] = job.semantic_cache
    return headers
