"""The pool's worker token: the user's Secret, or one the operator makes once (pure).

Without a token, worker gRPC and the KV port answer any pod the NetworkPolicy lets in (and
every pod, on a cluster whose network plugin ignores NetworkPolicies). So a pool that names
no `workerTokenSecret` gets `<pool>-worker-token`: a random token the operator creates the
first time it reconciles the pool and never writes again (a create that finds it there
changes nothing, so it is not rotated and running pods keep agreeing on it). The pool owns
it, so deleting the pool collects it. The token is never logged and never read back: the
operator may create Secrets, not read them.
"""

from __future__ import annotations

import base64
import secrets

from kvflow.operator.api import v1alpha1, v1alpha1_router
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import PoolRef, metadata

GENERATED_TOKEN_KEY = "token"
TOKEN_BYTES = 32  # 256 random bits, as url-safe base64 (43 characters)


def generated_token_secret_name(pool_name: str) -> str:
    return f"{pool_name}-worker-token"


def effective_worker_token(
    pool_name: str, spec: v1alpha1.InferencePoolSpec
) -> v1alpha1_router.SecretKeyRef:
    """The Secret key the pool's workers and routers read their token from."""
    if spec.worker_token_secret is not None:
        return spec.worker_token_secret
    return v1alpha1_router.SecretKeyRef(
        name=generated_token_secret_name(pool_name), key=GENERATED_TOKEN_KEY
    )


def generated_token_secret(pool: PoolRef, token: str | None = None) -> dict[str, Json]:
    """The Secret to create when the pool names none; `token` for tests, else random."""
    value = token if token is not None else secrets.token_urlsafe(TOKEN_BYTES)
    meta = metadata(pool, generated_token_secret_name(pool.name), "worker", "worker-token")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "data": {GENERATED_TOKEN_KEY: base64.b64encode(value.encode()).decode()},
    }
