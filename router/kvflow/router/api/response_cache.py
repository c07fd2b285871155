"""The response cache on the request path (caches/, docs/router.md "Response cache"): the
lookup once the pool is known (api/job_start.py), and the one line that picks a hit's
replay or the live stream, recorded for storing (api/completions.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from starlette.requests import Request

from kvflow.proto import worker_pb2 as pb
from kvflow.router.api.backend import PoolBackend
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import read_json_body
from kvflow.router.caches.key import model_version, tenant_user
from kvflow.router.caches.service import OFF, CacheTicket
from kvflow.router.degrade.service import RequestDegradation
from kvflow.router.protocol.errors import ApiError, invalid_request
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest
from kvflow.router.serving.defaults import apply_sampling_defaults
from kvflow.router.tenants.config import Tenant

# Where the completions handler leaves the body's prompt_cache_key for the lookup.
_USER_STATE = "response_cache_user"


def remember_user(request: Request, body: object) -> None:
    """Keep the body's ``prompt_cache_key``: answers are kept per user under a tenant."""
    setattr(request.state, _USER_STATE, tenant_user(body))


async def look_up(
    request: Request,
    gw: Gateway,
    parsed: ChatRequest | CompletionRequest,
    tenant: Tenant,
    route: tuple[PoolBackend, str, pb.WorkerInfo],
    degradation: RequestDegradation | None = None,
) -> CacheTicket:
    """The request's ticket: a hit carries the stored answer. ``route``: the answering
    pool's backend, its served name, and its workers' facts (their model identity).
    Under its model's response_cache degradation step a sampled request may get its greedy
    twin's answer; the step is then named in its ``x-kvflow-degraded``. After an exact miss
    (or with the exact cache off) a model opted in to the semantic cache asks it
    (caches/semantic_service.py)."""
    semantic = gw.semantic_cache
    is_semantic = semantic.applies_to(parsed.model)
    if not gw.response_cache.config.is_enabled and not is_semantic:
        return OFF
    backend, served_name, info = route
    template = backend.text.chat_template
    version = model_version(
        backend.name, served_name, info, template.source if template is not None else None
    )
    sampling = apply_sampling_defaults(parsed.sampling, backend.sampling_defaults)
    user = getattr(request.state, _USER_STATE, None)
    ticket = OFF
    if gw.response_cache.config.is_enabled:
        serves_sampled = degradation is not None and degradation.serves_sampled
        ticket = await gw.response_cache.look_up(
            request.headers, parsed, sampling, tenant, version, user=user,
            serves_sampled=serves_sampled,
        )  # fmt: skip
        if ticket.is_twin and ticket.is_hit and degradation is not None:
            degradation.served_from_cache()
    if is_semantic and not ticket.is_hit:  # an exact hit needs no near one
        near = await semantic.look_up(request.headers, parsed, sampling, tenant, version, user)
        ticket = dataclasses.replace(ticket, semantic=near)
    return ticket


# As tenants/config.py checks tenant names: no glob characters reach a purge's SCAN.
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# A purge's body is two names at most.
_MAX_PURGE_BODY_BYTES = 4096


async def purge(request: Request, gw: Gateway) -> dict[str, Any]:
    """``POST /v1/response_cache/purge`` (admins): drop the stored answers of a pool, of a
    tenant, of a tenant in a pool, or all (``{}``). For a model changed in a way the router
    cannot see; a changed model identity needs none (docs/router.md, "Response cache")."""
    caller = gw.authenticate(request.headers)
    if not caller.is_admin:
        raise ApiError(403, "Purging the response cache is for admin tenants.",
                       code="permission_denied")  # fmt: skip
    body = await read_json_body(request, _MAX_PURGE_BODY_BYTES)
    if not isinstance(body, dict) or set(body) - {"pool", "tenant"}:
        raise invalid_request("The body must be a JSON object with 'pool' and/or 'tenant'.")
    pools = [b.name for b in gw.backends]
    pool, tenant = body.get("pool"), body.get("tenant")
    if pool is not None and pool not in pools:
        raise invalid_request(f"Unknown pool {pool!r}; pools: {pools}.", param="pool")
    # A tenant removed from the config may still have answers stored: any plain name.
    if tenant is not None and (not isinstance(tenant, str) or not TENANT_NAME.match(tenant)):
        raise invalid_request("'tenant' must be a tenant's name.", param="tenant")
    deleted = 0
    for cache in (gw.response_cache, gw.semantic_cache):  # the exact and the near answers
        if tenant is None:
            deleted += await cache.purge(pool)
        else:
            deleted += sum([await cache.purge(p, tenant) for p in ([pool] if pool else pools)])
    return {"object": "response_cache.purge", "pool": pool, "tenant": tenant, "deleted": deleted}
