"""`/v1/chat/completions` and `/v1/completions`: one flow, two wire formats.

authenticate (401) -> parse, every request limit checked (400/413) -> model (404/403),
resolved to a pool -> a worker of that pool is up (503) -> the tenant's concurrency at this
replica (429) -> admission control (503/429) -> prepare on the prepare threads: schemas
compiled, template rendered, prompts tokenized (400; 503 when busy) -> prompt fits the
context (400) -> quotas (429) -> generate, stream or collect. The response's `model` is
the answering pool's served name.

The cheap refusals come first: nothing is rendered, tokenized or compiled for a request
that the limits, the tenant's concurrency or the cluster's queues turn away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.router.api.accounting import Accounting
from kvflow.router.api.backend import PoolBackend
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import (
    SERVED_MODEL_STATE,
    SERVED_POOL_STATE,
    read_json_body,
    wait_for_disconnect,
)
from kvflow.router.api.streaming import ManagedStreamingResponse, sse_body
from kvflow.router.protocol.errors import rate_limited
from kvflow.router.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    SamplingOptions,
    check_logit_bias,
    constraints_to_compile,
    parse_chat_request,
    parse_completion_request,
)
from kvflow.router.protocol.responses import (
    ChoiceDelta,
    ChoiceResult,
    ChunkWriter,
    chat_completion,
    text_completion,
)
from kvflow.router.serving.defaults import apply_sampling_defaults
from kvflow.router.serving.prepare import PreparePool
from kvflow.router.serving.prompts import PreparedPrompt
from kvflow.router.serving.tenant_gate import TenantGate
from kvflow.router.serving.token_budget import TokenBudget, plan_tokens
from kvflow.router.serving.types import (
    Caller,
    ChoiceSpec,
    ChoiceUsage,
    RequestTrace,
    new_request_id,
)
from kvflow.router.structured.constraint import check_constraint
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.prompt_cache import tenant_for_request
from kvflow.router.tenants.service import Lease
from kvflow.router.tools.extract import extractor_factory, with_tool_calls
from kvflow.router.tools.prompt import prepare_tool_prompt

ROUTE_DEBUG_HEADER = "x-kvflow-route"
_LIMIT_KINDS = {
    "requests_per_minute": "requests",
    "tokens_per_minute": "tokens",
    "max_concurrent_requests": "requests",
    "daily_token_budget": "insufficient_quota",
}


def _choice_sampling(s: SamplingOptions, j: int) -> SamplingOptions:
    # n > 1 with a seed: each choice its own reproducible stream, not n copies of one.
    return s if s.seed is None or j == 0 else replace(s, seed=s.seed + j)


def _build_specs(
    prompts: list[PreparedPrompt], s: SamplingOptions, budget: TokenBudget
) -> list[ChoiceSpec]:
    return [
        ChoiceSpec(
            index=i * s.n + j,
            prompt_index=i,
            prompt_token_ids=prompt.token_ids,
            sampling=_choice_sampling(replace(s, max_tokens=budget.max_tokens[i]), j),
        )
        for i, prompt in enumerate(prompts)
        for j in range(s.n)
    ]


async def _admit(gw: Gateway, tenant: Tenant, prompt_tokens: int, reserved_tokens: int) -> Lease:
    admission, lease = await gw.quotas.admit(tenant, prompt_tokens, reserved_tokens)
    if not admission.is_admitted:
        limit = admission.limit or "quota"
        gw.metrics.tenant_rejections.labels(tenant.name, limit).inc()
        raise rate_limited(
            f"Rate limit reached for tenant '{tenant.name}': {limit.replace('_', ' ')}. "
            f"Retry after {admission.retry_after_s:.1f} s.",
            retry_after_s=admission.retry_after_s,
            kind=_LIMIT_KINDS.get(limit, "requests"),
        )
    return lease


def _trace(request: Request) -> RequestTrace:
    """The caller's id for logs and the response; the workers get one made here."""
    request_id: str = request.state.request_id
    from_caller = request.headers.get("x-request-id") == request_id
    return RequestTrace(request_id, new_request_id() if from_caller else request_id)


def _prepare_pool(request: Request, gw: Gateway) -> PreparePool:
    """The app's prepare threads, made on its first request."""
    pool: PreparePool | None = getattr(request.app.state, "prepare_pool", None)
    if pool is None:
        refusals = gw.metrics.prepare_refusals
        pool = request.app.state.prepare_pool = PreparePool(
            gw.settings.prepare, on_refusal=lambda reason: refusals.labels(reason=reason).inc()
        )
    return pool


def _tenant_gate(request: Request) -> TenantGate:
    """The app's count of requests in flight per tenant, made on its first request."""
    gate: TenantGate | None = getattr(request.app.state, "tenant_gate", None)
    if gate is None:
        gate = request.app.state.tenant_gate = TenantGate()
    return gate


def _prepare(
    backend: PoolBackend, parsed: ChatRequest | CompletionRequest, template_source: str | None
) -> list[PreparedPrompt]:
    """On a prepare thread: compile the schemas and grammars, render, tokenize."""
    for constraint in constraints_to_compile(parsed):
        check_constraint(constraint)
    if isinstance(parsed, ChatRequest):
        messages, tool_variables = prepare_tool_prompt(
            parsed.messages, parsed.tools, parsed.tool_choice, template_source
        )
        return [
            backend.prompts.chat(
                messages,
                add_generation_prompt=parsed.add_generation_prompt,
                template_kwargs={**parsed.chat_template_kwargs, **tool_variables},
            )
        ]
    return [backend.prompts.completion(p) for p in parsed.prompts]


async def handle_completion(request: Request, *, is_chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    trace = _trace(request)
    tenant = gw.authenticate(request.headers)
    body = await read_json_body(request, gw.settings.config.max_body_bytes)
    tenant = tenant_for_request(tenant, body)  # prompt_cache_key: a per-user cache salt
    limits = gw.settings.request_limits
    parsed: ChatRequest | CompletionRequest = (
        parse_chat_request(body, limits) if is_chat else parse_completion_request(body, limits)
    )
    session_id = request.headers.get(gw.session_header)
    route = gw.route(parsed.model, tenant, session_id)
    backend, served_name = route.backend, route.served_name
    setattr(request.state, SERVED_MODEL_STATE, served_name)
    setattr(request.state, SERVED_POOL_STATE, backend.name)
    info = backend.model_info(served_name, label=gw.has_pools)
    check_logit_bias(parsed.sampling, info.vocab_size)
    template = backend.text.chat_template
    template_source = template.source if template is not None else None
    # The cheap refusals before any work: the tenant's concurrency here, a full cluster.
    # Once past them the request counts as in flight (for both) until it ends: `leave`.
    in_flight = contextlib.ExitStack()
    leave = in_flight.close
    try:
        in_flight.callback(_tenant_gate(request).enter(tenant))
        if backend.admission is not None:  # 503/429 from the workers' queues
            backend.admission.check(tenant, served_name)
            in_flight.enter_context(backend.admission.in_flight(tenant))
            trace.is_admitted = True
        prompts = await _prepare_pool(request, gw).run(
            lambda: _prepare(backend, parsed, template_source)
        )
        sampling = apply_sampling_defaults(parsed.sampling, backend.sampling_defaults)
        prompt_lens = [len(p.token_ids) for p in prompts]
        budget = plan_tokens(prompt_lens, sampling,
                             max_len=backend.max_model_len(info.max_model_len),
                             policy=backend.token_policy(tenant, parsed.model),
                             is_chat=is_chat)  # fmt: skip
        lease = await _admit(gw, tenant, sum(prompt_lens), budget.reserved_tokens)
    except BaseException:
        leave()
        raise
    accounting = Accounting(gw, tenant, lease, trace, parsed.model, sampling.n * len(prompts),
                            pool=backend.name if gw.has_pools else None,
                            served_model=served_name, on_finish=leave)  # fmt: skip
    caller = Caller(tenant, served_name, session_id)
    stream: AsyncGenerator[ChoiceDelta | ChoiceUsage] = backend.service.run(
        caller, _build_specs(prompts, sampling, budget), trace, buffered=not parsed.stream
    )
    tool_extractor = (
        extractor_factory(parsed, template_source) if isinstance(parsed, ChatRequest) else None
    )
    if tool_extractor is not None:
        stream = with_tool_calls(stream, tool_extractor)
    response_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
    created_s = int(time.time())
    is_echo = isinstance(parsed, CompletionRequest) and parsed.echo
    echo = [p.text for p in prompts] if is_echo else None
    # Worker addresses and scores: for admin tenants only (and the one caller of a gateway
    # without tenants); anyone else asking gets the answer without them.
    want_route = ROUTE_DEBUG_HEADER in request.headers and tenant.is_admin
    route_label = f"pool={backend.name}; " if gw.has_pools else ""
    if not parsed.stream:
        try:
            return await _collect(request, parsed, stream, accounting, response_id, created_s,
                                  echo, want_route, trace, route_label, served_name)  # fmt: skip
        finally:
            await stream.aclose()
            await accounting.finish()
    try:
        # Errors before any output keep their HTTP status.
        first = await _first_unless_disconnected(request, stream)
    except BaseException:
        await stream.aclose()
        await accounting.finish()
        raise
    if first is None:  # the client left before the first token; the workers' calls are gone
        await stream.aclose()
        await accounting.finish()
        return Response(status_code=499)
    writer = ChunkWriter(
        response_id,
        created_s,
        served_name,
        is_chat=is_chat,
        with_logprobs=sampling.logprobs,
        include_usage=parsed.include_usage,
        continuous_usage=parsed.stream_options.continuous_usage_stats,
    )
    body_iter = sse_body(first, stream, writer, accounting, sampling.n * len(prompts),
                          is_chat, echo, sampling.n)  # fmt: skip

    async def close() -> None:
        await body_iter.aclose()
        await stream.aclose()
        await accounting.finish()

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    if want_route:
        headers[ROUTE_DEBUG_HEADER] = _route_header(route_label, trace)
    return ManagedStreamingResponse(body_iter, close, headers)


def _route_header(label: str, trace: RequestTrace) -> str:
    """Each attempt's route, after the pool that answered when there are several."""
    return ", ".join(label + route for route in trace.routes)


async def _first_unless_disconnected(
    request: Request, stream: AsyncGenerator[ChoiceDelta | ChoiceUsage]
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
    request: Request,
    parsed: ChatRequest | CompletionRequest,
    stream: AsyncGenerator[ChoiceDelta | ChoiceUsage],
    accounting: Accounting,
    response_id: str,
    created_s: int,
    echo: list[str] | None,
    want_route: bool,
    trace: RequestTrace,
    route_label: str,
    served_name: str,
) -> Response:
    n = parsed.sampling.n
    num_prompts = 1 if isinstance(parsed, ChatRequest) else len(parsed.prompts)
    results = [ChoiceResult(i) for i in range(n * num_prompts)]
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
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    consumer.result()  # re-raises an ApiError from generation
    build = chat_completion if isinstance(parsed, ChatRequest) else text_completion
    body = build(response_id, created_s, served_name, results, accounting.usage,
                 with_logprobs=parsed.sampling.logprobs)  # fmt: skip
    headers = {ROUTE_DEBUG_HEADER: _route_header(route_label, trace)} if want_route else None
    return JSONResponse(body, headers=headers)
