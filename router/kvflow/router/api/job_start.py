"""From a parsed request to a running `CompletionJob` (serving/job.py), cheapest refusal first.

model (404/403), resolved to a pool -> a worker of that pool is up (503) -> the tenant's
concurrency at this replica (429) -> the tenant's quotas, checked against the least the
request can reserve (429: requests per minute, tokens per minute, daily token budget, daily
and monthly budgets in USD) -> the client IP's, the model's and the gateway's limits, the
same way (429 naming the limit; limits/) ->
admission control (503/429) -> prepare on the prepare threads: schemas compiled, template
rendered, prompts tokenized (400; 503 when busy) -> prompt fits the context, max_tokens
planned (400) -> the levels' limits, then the tenant's quotas, admit the request with its
real reservation (429).

Nothing is rendered, tokenized or compiled for a request that the tenant's limits or the
cluster's queues turn away. The quota check before preparing takes nothing; the admission
after it decides, atomically as before, so a request admitted there is counted once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from kvflow.router.api.accounting import Accounting
from kvflow.router.api.backend import PoolBackend
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import SERVED_MODEL_STATE, SERVED_POOL_STATE
from kvflow.router.api.response_cache import look_up as look_up_answer
from kvflow.router.batch.scope import BATCH_SCOPE_KEY
from kvflow.router.caches.service import OFF, CacheTicket
from kvflow.router.degrade.service import RequestDegradation
from kvflow.router.limits.client_ip import client_address
from kvflow.router.limits.levels import Slot
from kvflow.router.limits.service import LevelLease
from kvflow.router.protocol.errors import ApiError, rate_limited
from kvflow.router.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    check_logit_bias,
    constraints_to_compile,
)
from kvflow.router.serving.defaults import apply_sampling_defaults
from kvflow.router.serving.embeddings import refuse_unless_generating
from kvflow.router.serving.job import CompletionJob, ServedBy, TenantContext
from kvflow.router.serving.prepare import PreparePool
from kvflow.router.serving.prompts import PreparedPrompt
from kvflow.router.serving.tenant_gate import TenantGate
from kvflow.router.serving.token_budget import plan_tokens, reservation_floor
from kvflow.router.serving.types import RequestTrace, new_request_id
from kvflow.router.structured.constraint import check_constraint
from kvflow.router.tenants.money import format_usd
from kvflow.router.tenants.service import Lease
from kvflow.router.tenants.store import Admission
from kvflow.router.text.chat_template import check_render_deadline
from kvflow.router.tools.prompt import prepare_tool_prompt

ROUTE_DEBUG_HEADER = "x-kvflow-route"
_LIMIT_KINDS = {
    "requests_per_minute": "requests",
    "tokens_per_minute": "tokens",
    "max_concurrent_requests": "requests",
    "daily_token_budget": "insufficient_quota",
    "daily_budget_usd": "insufficient_quota",
    "monthly_budget_usd": "insufficient_quota",
}
_BUDGETS = ("daily_budget_usd", "monthly_budget_usd")
# Set when the tenant's spend is past a budget's warning fraction (tenants/money.py).
BUDGET_WARNING_HEADER = "x-kvflow-budget-warning"


@dataclass
class StartedJob:
    """A job admitted everywhere: its backend runs it; its accounting settles it once."""

    job: CompletionJob
    backend: PoolBackend
    accounting: Accounting
    cache: CacheTicket = OFF  # the response cache's: a hit replays its stored answer


async def start_job(
    request: Request,
    gw: Gateway,
    parsed: ChatRequest | CompletionRequest,
    tenant: TenantContext,
    degradation: RequestDegradation | None = None,
) -> StartedJob:
    """Route, gate, prepare and admit ``parsed``; raises the ApiError of the first refusal.
    Once past the gates the request counts as in flight (the tenant's concurrency here,
    admission control) until its accounting finishes."""
    trace = _trace(request)
    degradation = degradation or RequestDegradation(parsed)  # none configured: no steps
    route = gw.route(parsed.model, tenant.tenant, tenant.session_id)
    backend, served_name = route.backend, route.served_name
    setattr(request.state, SERVED_MODEL_STATE, served_name)
    setattr(request.state, SERVED_POOL_STATE, backend.name)
    info = backend.model_info(served_name, label=gw.has_pools)
    refuse_unless_generating(info, served_name)  # 400: an embedding model's pool
    check_logit_bias(parsed.sampling, info.vocab_size)
    template = backend.text.chat_template
    template_source = template.source if template is not None else None
    policy = backend.token_policy(tenant.tenant, parsed.model)
    cached = await look_up_answer(
        request, gw, parsed, tenant.tenant, (backend, served_name, info), degradation
    )
    in_flight = contextlib.ExitStack()
    try:
        in_flight.callback(_tenant_gate(request).enter(tenant.tenant))
        num_prompts = 1 if isinstance(parsed, ChatRequest) else len(parsed.prompts)
        floor = reservation_floor(num_prompts, parsed.sampling, policy)
        _raise_unless_admitted(gw, tenant, await gw.quotas.check(tenant.tenant, floor))
        levels = _level_slots(request, gw, served_name)
        await gw.limits.check(levels, floor)
        # 503/429 from the workers' queues; a cached answer runs on no worker.
        if backend.admission is not None and not cached.is_hit:
            await degradation.admit(
                backend.admission, tenant.tenant, served_name, tenant.priority_class
            )
            in_flight.enter_context(backend.admission.in_flight(tenant.tenant))
            trace.is_admitted = True
        prompts = await _prepare_pool(request, gw).run(
            lambda: _prepare(backend, parsed, template_source)
        )
        sampling = apply_sampling_defaults(parsed.sampling, backend.sampling_defaults)
        prompt_lens = [len(p.token_ids) for p in prompts]
        budget = plan_tokens(
            prompt_lens,
            sampling,
            max_len=backend.max_model_len(info.max_model_len),
            policy=policy,
            is_chat=isinstance(parsed, ChatRequest),
        )
        capped = degradation.cap(budget, prompt_lens, sampling.n)  # cap_max_tokens
        if capped != budget:  # its key says max_tokens unset: the cut answer is not that
            cached = cached.without_store()
        budget = capped
        # A cached answer generates nothing: it reserves its prompt only.
        reserved = sum(prompt_lens) if cached.is_hit else budget.reserved_tokens
        level_lease = await gw.limits.admit(levels, reserved)
        try:
            lease, admission = await _admit(gw, tenant, sum(prompt_lens), reserved)
        except BaseException:
            await gw.limits.finish(level_lease, 0, is_cancelled=True)
            raise
    except BaseException:
        in_flight.close()
        raise
    served_by = ServedBy(backend.name, served_name, backend.name if gw.has_pools else None)
    job = CompletionJob(
        request=parsed,
        tenant=tenant,
        served_by=served_by,
        trace=trace,
        prompts=tuple(prompts),
        sampling=sampling,
        budget=budget,
        template_source=template_source,
        response_id=("chatcmpl-" if isinstance(parsed, ChatRequest) else "cmpl-")
        + uuid.uuid4().hex,
        created_s=int(time.time()),
        # Worker addresses and scores: for admin tenants only (and the one caller of a
        # gateway without tenants); anyone else asking gets the answer without them.
        wants_route=ROUTE_DEBUG_HEADER in request.headers and tenant.is_admin,
        budget_warning=admission.budget_warning,
        degraded=degradation.header,
        response_cache=cached.result,
        semantic_cache=cached.semantic.header(),
    )
    if admission.warning_budget is not None:
        gw.metrics.tenant_budget_warnings.labels(tenant.name, admission.warning_budget).inc()
    accounting = _accounting(gw, job, lease, on_finish=in_flight.close, level_lease=level_lease)
    accounting.degradation = degradation
    accounting.is_replayed = cached.is_hit
    if request.scope.get(BATCH_SCOPE_KEY):  # a Batch API line: at the batch price
        accounting.price_factor = gw.settings.batch.price_factor
    return StartedJob(job, backend, accounting, cached)


def _level_slots(request: Request, gw: Gateway, served_name: str) -> tuple[Slot, ...]:
    """The client IP's, the model's and the gateway's counters this request draws on."""
    config = gw.limits.config
    if not config.is_limited:
        return ()
    client = None
    # A Batch API line has no client of its own (the batch's creator was limited when it
    # uploaded and created it): all lines keyed as one unknown address would share one
    # bucket across every tenant's batches.
    if config.client_ip.is_limited and not request.scope.get(BATCH_SCOPE_KEY):
        peer = request.client.host if request.client is not None else None
        forwarded = request.headers.getlist("x-forwarded-for")
        client = client_address(peer, forwarded, config.trusted_proxies)
    return gw.limits.slots(client, served_name)


def _accounting(
    gw: Gateway,
    job: CompletionJob,
    lease: Lease,
    on_finish: Callable[[], None],
    level_lease: LevelLease | None = None,
) -> Accounting:
    return Accounting(
        gw,
        job.tenant.tenant,
        lease,
        job.trace,
        job.request.model,
        job.num_choices,
        pool=job.served_by.pool_label,
        served_model=job.served_by.served_model,
        priority_class=job.tenant.priority_class.value,
        on_finish=on_finish,
        level_lease=level_lease,
    )


def _raise_unless_admitted(gw: Gateway, tenant: TenantContext, admission: Admission) -> None:
    if not admission.is_admitted:
        limit = admission.limit or "quota"
        gw.metrics.tenant_rejections.labels(tenant.name, limit).inc()
        raise _quota_exceeded(tenant, admission, limit)


def _quota_exceeded(tenant: TenantContext, admission: Admission, limit: str) -> ApiError:
    if limit in _BUDGETS:
        budget = tenant.tenant.quotas.budgets
        amount = budget.daily_pusd if limit == "daily_budget_usd" else budget.monthly_pusd
        period = "day" if limit == "daily_budget_usd" else "month"
        return rate_limited(
            f"Budget reached for tenant '{tenant.name}': {limit} "
            f"({format_usd(amount or 0)}) is spent. It resets at the next UTC {period}, "
            f"in {admission.retry_after_s:.0f} s.",
            retry_after_s=admission.retry_after_s,
            kind=_LIMIT_KINDS[limit],
        )
    return rate_limited(
        f"Rate limit reached for tenant '{tenant.name}': {limit.replace('_', ' ')}. "
        f"Retry after {admission.retry_after_s:.1f} s.",
        retry_after_s=admission.retry_after_s,
        kind=_LIMIT_KINDS.get(limit, "requests"),
    )


async def _admit(
    gw: Gateway, tenant: TenantContext, prompt_tokens: int, reserved_tokens: int
) -> tuple[Lease, Admission]:
    admission, lease = await gw.quotas.admit(tenant.tenant, prompt_tokens, reserved_tokens)
    _raise_unless_admitted(gw, tenant, admission)
    return lease, admission


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
        # Each schema may take a moment: with a hundred tools, the request's time limit
        # ran out long before its compiles did, and its thread stayed busy for them all.
        check_render_deadline()
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
