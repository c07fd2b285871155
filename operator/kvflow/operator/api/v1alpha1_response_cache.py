"""The router's response cache in the RouterSpec, version v1alpha1 (docs/router.md,
"Response cache").

Split from ``v1alpha1`` (whose RouterSpec embeds it) to keep each file one concept. The
operator turns it into the router's --response-cache* flags (builders/router.py); unset
fields keep the router's defaults. An InferenceModel's `response_cache` degradation step
needs it on in its gateway (builders/gateway_models.py leaves the step out otherwise).
Pure: imports neither kopf nor kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import field


@dataclass(frozen=True)
class ResponseCacheSpec:
    """An exact cache of answers: a deterministic request (temperature 0 or a seed) asked
    again by the same tenant of the same model version gets the stored answer, without
    reaching a worker. Shared through the router's Redis when it has one."""

    enabled: bool = field(
        """true: the router answers repeated deterministic requests from the cache (and a
        model's response_cache degradation step can take effect). Off by default: callers
        of an OpenAI-compatible server expect every request to reach the model.""",
        False,
    )
    ttl_seconds: float | None = field(
        "How long an answer is kept (router default 300).",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=86400,
    )
    max_mib: float | None = field(
        """The in-process store's size in MiB, used without a Redis; least recently used
        answers go first (router default 64).""",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=65536,
    )
    max_entry_kib: float | None = field(
        "A larger answer is answered, not stored, in KiB (router default 256).",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=65536,
    )
