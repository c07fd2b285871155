"""The response cache on the request path (caches/, docs/router.md "Response cache"): the
lookup once the pool is known (api/job_start.py), and the one line that picks a hit's
replay or the live stream, recorded for storing (api/completions.py)."""

from __future__ import annotations

from starlette.requests import Request

from kvflow.proto import worker_pb2 as pb
from kvflow.router.api.backend import PoolBackend
from kvflow.router.api.gateway import Gateway
from kvflow.router.caches.key import model_version, tenant_user
from kvflow.router.caches.service import CacheTicket
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
) -> CacheTicket:
    """The request's ticket: a hit carries the stored answer. ``route``: the answering
    pool's backend, its served name, and its workers' facts (their model identity)."""
    backend, served_name, info = route
    template = backend.text.chat_template
    version = model_version(
        backend.name, served_name, info, template.source if template is not None else None
    )
    sampling = apply_sampling_defaults(parsed.sampling, backend.sampling_defaults)
    user = getattr(request.state, _USER_STATE, None)
    return await gw.response_cache.look_up(
        request.headers, parsed, sampling, tenant, version, user=user
    )
