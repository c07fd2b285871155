"""A request's ``prompt_cache_key`` as a per-user cache salt under its tenant's
(tenants/salts.py): requests with different keys never share cached blocks."""

from __future__ import annotations

import json
from dataclasses import replace

from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.salts import user_salt


def tenant_for_request(tenant: Tenant, body: object) -> Tenant:
    """``tenant`` with the salt of the body's ``prompt_cache_key``, if it has one. OpenAI's
    field is a string; the schema (api/openapi_requests.py) takes any value, which then
    keys by its JSON text rather than failing."""
    key = body.get("prompt_cache_key") if isinstance(body, dict) else None
    if key is None:
        return tenant
    text = key if isinstance(key, str) else json.dumps(key, sort_keys=True)
    return replace(tenant, cache_salt=user_salt(tenant.cache_salt, text))
