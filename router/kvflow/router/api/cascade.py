"""A cascaded model's request (cascade/): the small model answers first, in full, and its
answer is checked; it is sent as it is, or the large model answers instead.

The small call always asks its worker for logprobs (the check needs them); the client sees
them only if it asked. The small answer is generated whole before anything is sent, also
for a streaming request: a stream can only be escalated before its first token, so the
check must be decided first. A small answer that passes is then replayed as the stream
(all at once); an escalated request streams the large model's answer live. The cost: a
streaming client's first token comes after the small model's whole answer (plus, when
escalated, the large model's time to first token) — docs/router.md, "Model cascade".

Each call is admitted, charged and logged as its own request (quotas, prices of the model
that ran it); an escalated response's usage is both calls' tokens summed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import Response

from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import wait_for_disconnect
from kvflow.router.api.job_start import StartedJob, start_job
from kvflow.router.api.respond import CLIENT_GONE, collected, streamed
from kvflow.router.cascade.checks import Reason, SmallChoice, escalation
from kvflow.router.cascade.config import CascadeSpec
from kvflow.router.cascade.service import CASCADE_HEADER, header
from kvflow.router.degrade.service import RequestDegradation
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.job import TenantContext
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.tools.extract import extractor_factory, with_tool_calls

Item = ChoiceDelta | ChoiceUsage
AnyRequest = ChatRequest | CompletionRequest
# The request fields whose JSON output format the json check applies to.
_JSON_PARAMS = ("response_format", "structured_outputs")
# A small call failing with this status or above (no worker, a worker lost) escalates.
_SERVER_ERROR = 500


async def answer_with_cascade(
    request: Request,
    gw: Gateway,
    parsed: AnyRequest,
    context: TenantContext,
    degradation: RequestDegradation,
    spec: CascadeSpec,
) -> Response:
    small_request = replace(parsed, model=spec.small,
                            sampling=replace(parsed.sampling, logprobs=True))  # fmt: skip
    small: StartedJob | None = None
    reason: Reason | None = None
    small_usage = UsageCounts()
    try:
        small = await start_job(request, gw, small_request, context, degradation)
    except ApiError as exc:
        if exc.status < _SERVER_ERROR:  # the request's own fault, or a quota: no escalation
            degradation.refused(exc)
            raise
        reason = "small_error"
    if small is not None:
        job, accounting = small.job, small.accounting
        accounting.model = degradation.asked_model  # the log line's: the name the client sent
        stream = small.backend.service.run(job.caller, job.specs(), job.trace, buffered=True)
        try:
            items, error, is_gone = await _buffered(request, stream)
        except BaseException:
            await accounting.finish()
            raise
        if is_gone:  # the client left: the workers' calls are cancelled
            for item in items:
                accounting.add(item)
            # Charged what the small call computed, as any request cut short (respond.py).
            accounting.charge_unsettled([len(prompt.token_ids) for prompt in job.prompts])
            accounting.is_client_gone = True
            accounting.degradation = None
            await accounting.finish()
            return Response(status_code=CLIENT_GONE)
        reason = "small_error" if error is not None else escalation(
            _choices(items, job.num_choices), spec.checks, _json_kind(parsed)
        )  # fmt: skip
        accounting.cascade = header(reason)
        if reason is None:
            gw.cascade.count(spec, None)
            # The client's logprobs setting: the small call's own are not shown unasked.
            shown = replace(job, sampling=replace(job.sampling, logprobs=parsed.sampling.logprobs))
            replay = _with_tools(parsed, job.template_source, _replay(items))
            respond = streamed if parsed.stream else collected
            response = await respond(request, shown, replay, accounting)
            response.headers[CASCADE_HEADER] = header(None)
            return response
        # Escalated: the small call is settled now, at its own model's prices; the latency
        # it cost is the large call's too (its trace starts when the request arrived).
        for item in items:
            accounting.add(item)
        accounting.degradation = None  # the answer's timings are the large call's
        await accounting.finish()
        small_usage = accounting.usage
    assert reason is not None
    gw.cascade.count(spec, reason)
    try:
        large = await start_job(request, gw, replace(parsed, model=spec.large), context,
                                degradation)  # fmt: skip
    except BaseException as exc:
        degradation.refused(exc)
        raise
    if small is not None:
        large.job.trace.arrival_s = small.job.trace.arrival_s
    large.accounting.prior_usage = small_usage
    large.accounting.cascade = header(reason)
    job = large.job
    live = large.backend.service.run(job.caller, job.specs(), job.trace, buffered=not parsed.stream)
    respond = streamed if parsed.stream else collected
    response = await respond(request, job, _with_tools(parsed, job.template_source, live),
                             large.accounting)  # fmt: skip
    response.headers[CASCADE_HEADER] = header(reason)
    return response


async def _buffered(
    request: Request, stream: AsyncGenerator[Item]
) -> tuple[list[Item], ApiError | None, bool]:
    """Every item of the small call, the server error that ended it early (returned, not
    raised: the large model answers instead), and whether the client left first (the
    stream is then closed, which cancels the workers' calls; the items so far come back)."""
    items: list[Item] = []

    async def consume() -> None:
        async for item in stream:
            items.append(item)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        await asyncio.gather(consumer, watcher, return_exceptions=True)
        await stream.aclose()
    if consumer.cancelled():
        return items, None, True
    error = consumer.exception()
    if isinstance(error, ApiError) and error.status >= _SERVER_ERROR:
        return items, error, False
    if error is not None:
        raise error
    return items, None, False


async def _replay(items: Sequence[Item]) -> AsyncGenerator[Item]:
    for item in items:
        yield item


def _with_tools(
    parsed: AnyRequest, template_source: str | None, stream: AsyncGenerator[Item]
) -> AsyncGenerator[Item]:
    if isinstance(parsed, ChatRequest):
        factory = extractor_factory(parsed, template_source)
        if factory is not None:
            return with_tool_calls(stream, factory)
    return stream


def _choices(items: Sequence[Item], num_choices: int) -> list[SmallChoice]:
    texts = [""] * num_choices
    logprobs: list[list[float]] = [[] for _ in range(num_choices)]
    for item in items:
        if isinstance(item, ChoiceDelta):
            texts[item.index] += item.text
            logprobs[item.index].extend(t.logprob for t in item.logprobs)
    return [SmallChoice(t, tuple(lp)) for t, lp in zip(texts, logprobs, strict=True)]


def _json_kind(parsed: AnyRequest) -> str | None:
    constraint = parsed.sampling.constraint
    if constraint is None or not constraint.param.startswith(_JSON_PARAMS):
        return None
    return constraint.kind
