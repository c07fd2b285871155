"""`/v1/embeddings`: OpenAI's embeddings, from a pool of embedding workers, metered as
completions are.

authenticate (401) -> parse (400/413) -> model (404/403), its pool's workers embed (400 for
a generating pool, 503 while none is up), input count and dimensions within what they
allow (400) -> the tenant's concurrency here (429) -> the tenant's quotas and the client
IP's, the model's and the gateway's limits, checked against the least the request can use
(429: one token per text, a token array's length) -> embed (400 for input the worker
refuses, such as one past its tokens per input) -> the quotas and limits admit the exact
tokens (429) -> settled at once: usage, spend at the model's input price, the request log
line, metrics.

Only the worker tokenizes (the tokenizer is part of the embedding model), so the exact
count is known once the vectors are: admitting then, atomically as completions are
admitted, means no quota is ever overdrawn, and a request refused there costs the worker
one batch, which for a static embedding model is a lookup and a mean.
"""

from __future__ import annotations

import contextlib

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvflow.proto import worker_pb2 as pb
from kvflow.router.api.accounting import Accounting
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import SERVED_MODEL_STATE, SERVED_POOL_STATE, read_json_body

# The gate, checks and trace are the completions' own (one tenant gate per app, the same
# 429s); kept private there so that module's flow reads whole.
from kvflow.router.api.job_start import (
    _level_slots,
    _raise_unless_admitted,
    _tenant_gate,
    _trace,
)
from kvflow.router.protocol.embeddings import (
    check_against,
    embeddings_body,
    parse_embedding_request,
)
from kvflow.router.protocol.errors import invalid_request
from kvflow.router.protocol.responses import UsageCounts
from kvflow.router.serving.embeddings import embed, embedder_info
from kvflow.router.serving.job import TenantContext
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.tenants.config import Tenant


async def handle_embeddings(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tenant = TenantContext(gw.authenticate(request.headers))
    body = await read_json_body(request, gw.settings.config.max_body_bytes)
    parsed = parse_embedding_request(body)
    route = gw.route(parsed.model, tenant.tenant, None)
    backend, served_name = route.backend, route.served_name
    setattr(request.state, SERVED_MODEL_STATE, served_name)
    setattr(request.state, SERVED_POOL_STATE, backend.name)
    check_against(parsed, embedder_info(backend.pool, served_name, backend.name), served_name)
    trace = _trace(request)
    in_flight = contextlib.ExitStack()
    with in_flight:
        in_flight.callback(_tenant_gate(request).enter(tenant.tenant))
        floor = parsed.floor_tokens
        _raise_unless_admitted(gw, tenant, await gw.quotas.check(tenant.tenant, floor))
        levels = _level_slots(request, gw, served_name)
        await gw.limits.check(levels, floor)
        trace.routes.append(backend.name)
        result = await embed(
            backend.pool,
            served_name,
            parsed.inputs,
            dimensions=parsed.dimensions or 0,
            timeout_s=gw.settings.deadlines.first_token_s,
            request_id=trace.server_id,
            context=pb.RequestContext(
                tenant=tenant.name, priority_class=tenant.priority_class.to_pb()
            ),
        )
        tokens = result.prompt_tokens
        _raise_if_never_admitted(tenant.tenant, tokens)
        level_lease = await gw.limits.admit(levels, tokens)
        try:
            admission, lease = await gw.quotas.admit(tenant.tenant, tokens, tokens)
            _raise_unless_admitted(gw, tenant, admission)
        except BaseException:
            await gw.limits.finish(level_lease, 0, is_cancelled=True)
            raise
        accounting = Accounting(
            gw,
            tenant.tenant,
            lease,
            trace,
            parsed.model,
            pool=backend.name if gw.has_pools else None,
            served_model=served_name,
            priority_class=tenant.priority_class.value,
            level_lease=level_lease,
            endpoint="embeddings",
        )
        accounting.add(ChoiceUsage(0, 0, UsageCounts(prompt_tokens=tokens)))
        accounting.finish_reasons[0] = "stop"
        await accounting.finish()
    return JSONResponse(
        embeddings_body(result.vectors, parsed.encoding_format, served_name, tokens)
    )


def _raise_if_never_admitted(tenant: Tenant, tokens: int) -> None:
    """Inputs of more tokens than the tenant's whole minute can never be admitted: a 400,
    as for completions (serving/token_budget.py), not a 429 whose retries recompute them.
    Known only once the worker has counted them."""
    limit = tenant.quotas.tokens_per_minute
    if limit is not None and tokens > limit:
        raise invalid_request(
            f"Request too large for tenant '{tenant.name}' on tokens per minute: limit "
            f"{limit}, the input is {tokens} tokens. It can never be admitted: send fewer "
            "or shorter inputs.",
            param="input",
            code="tokens_per_minute_exceeded",
        )
