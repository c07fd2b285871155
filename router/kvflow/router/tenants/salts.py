"""Cache salts: which requests may share cached KV blocks. Pure.

A worker's block hashes chain the salt in, and they travel in KV-event streams (and reach
the router's index). A salt anyone can compute from a tenant's name would let whoever
reads such a stream test guesses of another tenant's prompts offline, so a tenant's
default salt is an HMAC of its name under a server-side secret: ``--cache-salt-secret-file``
or ``KVFLOW_CACHE_SALT_SECRET``. Every router replica must hold the same secret for their
requests to share a worker's prefix cache; without one, each process draws a random secret
and warns (one replica, as `kvflow up` runs, loses nothing).

A request's ``prompt_cache_key`` (OpenAI's field) narrows the salt further: its blocks are
shared only with requests of the same tenant and the same key, so `usage.cached_tokens`
tells one user of a tenant nothing about another's prompts when each sends its own key.
Requests without a key share the tenant's salt, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CACHE_SALT_SECRET_ENV = "KVFLOW_CACHE_SALT_SECRET"


def random_secret() -> bytes:
    return secrets.token_bytes(32)


def tenant_salt(secret: bytes, tenant_name: str) -> str:
    """The default salt of ``tenant_name``: unguessable without ``secret``."""
    return hmac.new(secret, b"kvflow-tenant:" + tenant_name.encode(), hashlib.sha256).hexdigest()


def user_salt(tenant_salt: str, prompt_cache_key: str) -> str:
    """The salt of the requests of one tenant carrying ``prompt_cache_key``: never equal to
    the tenant's own, nor to another key's (HMAC under the tenant's salt)."""
    mac = hmac.new(tenant_salt.encode(), b"kvflow-user:" + prompt_cache_key.encode(),
                   hashlib.sha256)  # fmt: skip
    return mac.hexdigest()
