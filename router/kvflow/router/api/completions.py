"""`/v1/chat/completions` and `/v1/completions`: one flow, two wire formats.

authenticate (401) -> parse, every request limit checked (400/413) -> a `CompletionJob`
routed, gated, prepared and admitted (api/job_start.py, where each refusal's order is
said) -> generate -> the answer, collected or streamed (api/respond.py). The response's
`model` is the answering pool's served name.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from kvflow.router.api.cascade import answer_with_cascade
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import read_json_body
from kvflow.router.api.job_start import start_job
from kvflow.router.api.respond import collected, streamed
from kvflow.router.api.response_cache import remember_user
from kvflow.router.protocol.priority_class import applied_class, requested_class
from kvflow.router.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from kvflow.router.protocol.responses import ChoiceDelta
from kvflow.router.serving.job import TenantContext
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.prompt_cache import tenant_for_request
from kvflow.router.tools.extract import extractor_factory, with_tool_calls


async def handle_completion(
    request: Request, *, is_chat: bool, tenant: Tenant | None = None
) -> Response:
    """``tenant``: the caller already known (a batch's line, batch/runner.py), else from
    the request's API key."""
    gw: Gateway = request.app.state.gateway
    if tenant is None:
        tenant = gw.authenticate(request.headers)
    body = await read_json_body(request, gw.settings.config.max_body_bytes)
    limits = gw.settings.request_limits
    parsed: ChatRequest | CompletionRequest = (
        parse_chat_request(body, limits) if is_chat else parse_completion_request(body, limits)
    )
    # The class asked for (400 on an unknown word), capped to the tenant's ceiling.
    priority_class = applied_class(
        requested_class(request.headers, body), tenant.max_priority_class
    )
    # prompt_cache_key: a per-user cache salt under the tenant's.
    context = TenantContext(
        tenant_for_request(tenant, body), request.headers.get(gw.session_header), priority_class
    )
    # The model's active degradation steps (degrade/service.py): a capped, plainer request,
    # maybe for its fallback model (also when the model's pools refuse requests: their
    # circuits open, or no healthy worker); its refusals and timings feed the model's ladder.
    degradation = gw.degradation.plan(parsed, context.tenant, gw.is_refusing)
    parsed = degradation.request
    remember_user(request, body)
    # A cascaded model (cascade/): its small model answers first, the large one if a check fails.
    cascade = gw.cascade.plan(parsed.model, context.tenant)
    if cascade is not None:
        return await answer_with_cascade(request, gw, parsed, context, degradation, cascade)
    try:
        started = await start_job(request, gw, parsed, context, degradation)
    except BaseException as exc:
        degradation.refused(exc)
        raise
    job, accounting, cached = started.job, started.accounting, started.cache
    if cached.is_hit:  # the stored answer, tool calls already extracted
        return await (streamed if parsed.stream else collected)(
            request, job, cached.replay([len(p.token_ids) for p in job.prompts]), accounting
        )
    stream: AsyncGenerator[ChoiceDelta | ChoiceUsage] = started.backend.service.run(
        job.caller, job.specs(), job.trace, buffered=not parsed.stream
    )
    if isinstance(parsed, ChatRequest):
        tool_extractor = extractor_factory(parsed, job.template_source)
        if tool_extractor is not None:
            stream = with_tool_calls(stream, tool_extractor)
    stream = cached.recording(stream, job.num_choices)  # stored once complete
    respond = streamed if parsed.stream else collected
    return await respond(request, job, stream, accounting)
