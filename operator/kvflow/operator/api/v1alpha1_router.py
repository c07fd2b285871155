"""The InferencePool API's router: the OpenAI-compatible gateway's replicas, Service, routing
weights, shared state, authentication and disaggregation policy (part of the v1alpha1 CRD;
a gateway's spec holds one too, ``v1alpha1_gateway``)."""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, JsonObject, cel, field
from kvflow.operator.api.v1alpha1_admission import AdmissionSpec
from kvflow.operator.api.v1alpha1_batch import BatchSpec
from kvflow.operator.api.v1alpha1_breaker import CircuitBreakerSpec
from kvflow.operator.api.v1alpha1_rate_limits import RateLimitsSpec
from kvflow.operator.api.v1alpha1_response_cache import ResponseCacheSpec
from kvflow.operator.api.v1alpha1_workers import PullPolicy, Resources

ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]


@dataclass(frozen=True)
class ScorerWeights:
    """The router's scorer weights, each field named as the router's scorer (in snake_case:
    docs/router.md, "Routing"). All unset: the router's default, which scores a worker by
    the seconds the request would cost there (timeCost 1, session 0.01). Any of
    prefixCache, queueDepth or kvCacheUsage set, and timeCost not: the block policy, a
    weighted sum of these scorers, its unset weights at the router's block defaults
    (prefixCache 1, queueDepth 1, session 8). Otherwise the time-based default, with the
    weights set here over its own."""

    prefix_cache: float | None = field(
        "Weight of the share of the prompt's blocks a worker already caches.", None, minimum=0
    )
    queue_depth: float | None = field("Weight of the (negated) queue length.", None, minimum=0)
    kv_cache_usage: float | None = field("Weight of the (negated) KV-cache fill.", None, minimum=0)
    time_cost: float | None = field(
        """Weight of the (negated) seconds the request would cost on a worker: the
        router's default scorer, at weight 1. 0 with a block weight set leaves the block
        policy as it is.""",
        None,
        minimum=0,
    )
    session: float | None = field(
        """Weight of returning to the worker that served the session last (0.01 by
        default, in seconds; 8 in the block policy, in blocks).""",
        None,
        minimum=0,
    )


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the pool's namespace."""

    name: str = field("Secret name.", min_length=1, max_length=253)
    key: str = field("Key inside the Secret.", min_length=1, max_length=253)


@cel(
    CelRule(
        "!(self.url != '' && has(self.urlSecret))",
        "router.redis takes url or urlSecret, not both",
    )
)
@dataclass(frozen=True)
class RedisSpec:
    """The Redis that router replicas share (tenant keys, quotas, rate limits)."""

    url: str = field(
        "redis:// URL; empty with no urlSecret: each router keeps its own in-memory state.",
        "",
        pattern="^(rediss?://.*)?$",
    )
    url_secret: SecretKeyRef | None = field("A Secret key holding the URL (password).", None)


@dataclass(frozen=True)
class DisaggregationSpec:
    """When the router hands a prompt to a prefill worker (mode disaggregated only).

    Each request is decided on its own: a prompt goes to a prefill worker only when the
    part the chosen decode worker does not cache is long enough and the prefill workers are
    not backed up; otherwise the decode worker prefills it itself. Unset fields keep the
    router's own defaults (`docs/router.md`).
    """

    min_remote_prefill_tokens: int | None = field(
        """Prefill on a prefill worker only when the decode worker lacks at least this many
        prompt tokens (short prompts cost more to ship than to compute).""",
        None,
        minimum=0,
        maximum=1048576,
    )
    max_prefill_queue_depth: int | None = field(
        "Skip prefill workers with more requests than this waiting; decode prefills instead.",
        None,
        minimum=0,
        maximum=65536,
    )
    transfer_timeout_seconds: float | None = field(
        """How long one KV transfer may take; past it the reserved blocks are freed on both
        workers and the request is retried or prefilled by the decode worker.""",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=600,
    )


# Secure by default: a gateway without tenants lets every caller in as an administrator with
# no quota, so it takes a named opt-in, and never on a Service reachable from outside. On
# the spec that holds `router` (a pool's or a gateway's), not on RouterSpec: the API server
# checks a field's default against its own rules, and the default router has no tenants.
ROUTER_AUTH_RULES = (
    CelRule(
        "has(self.router.tenantsSecret) || self.router.allowUnauthenticated",
        "router.tenantsSecret is required (the gateway's tenants and API keys); set "
        "router.allowUnauthenticated: true to serve without authentication",
        ".router",
    ),
    CelRule(
        "!self.router.allowUnauthenticated || self.router.serviceType == 'ClusterIP'",
        "router.allowUnauthenticated needs serviceType ClusterIP: an unauthenticated "
        "gateway is never exposed outside the cluster",
        ".router",
    ),
)


_HAS_REDIS = "(self.redis.url != '' || has(self.redis.urlSecret))"
_BATCH_STORAGE = "has(self.batch.storage) && self.batch.storage == "


@cel(
    CelRule(
        f"!({_BATCH_STORAGE}'Redis') || {_HAS_REDIS}",
        "router.batch.storage Redis needs router.redis (url or urlSecret)",
        ".batch.storage",
    ),
    CelRule(
        f"!({_BATCH_STORAGE}'Volume') || !{_HAS_REDIS}",
        "router.batch.storage Volume is unused while router.redis is set (the router "
        "keeps batches in its Redis); use storage Redis",
        ".batch.storage",
    ),
    CelRule(
        f"!({_BATCH_STORAGE}'Volume') || self.replicas == 1",
        "router.batch.storage Volume holds one router's batches: it needs router.replicas "
        "1 (use storage Redis for more replicas)",
        ".batch.storage",
    ),
)
@dataclass(frozen=True)
class RouterSpec:
    """The OpenAI-compatible gateway in front of the workers."""

    replicas: int = field("Router pods (active-active).", 1, minimum=1, maximum=64)
    image: str = field("Router image; empty means the operator's default.", "")
    image_pull_policy: PullPolicy = field("Pull policy of the router image.", "IfNotPresent")
    resources: Resources = field("CPU and memory of the router container.", Resources())
    service_type: ServiceType = field("Type of the gateway Service.", "ClusterIP")
    port: int = field("Port of the gateway Service.", 80, minimum=1, maximum=65535)
    scorer_weights: ScorerWeights = field("Routing weights.", ScorerWeights())
    redis: RedisSpec = field("Shared state for router replicas.", RedisSpec())
    tenants_secret: SecretKeyRef | None = field(
        """A Secret key holding the gateway's tenants: the `tenants:` list of docs/router.md
        (names, API key digests, models, quotas, priorities). Mounted into the router pods
        and re-read when the Secret changes, without a restart. Required unless
        allowUnauthenticated is true.""",
        None,
    )
    allow_unauthenticated: bool = field(
        """Serve without tenants: every caller is an administrator with no quota, all share
        one prefix cache and may ask for route explanations. Only with serviceType
        ClusterIP; for demos and tests. Ignored when tenantsSecret is set.""",
        False,
    )
    tenant_key_secret: SecretKeyRef | None = field(
        """A Secret key holding the server-side secret that the tenants'
        api_key_hmac_sha256 digests are made with (KVFLOW_TENANT_KEY_SECRET).""",
        None,
    )
    disaggregation: DisaggregationSpec = field(
        "Per-request disaggregation policy (used in mode disaggregated).", DisaggregationSpec()
    )
    admission: AdmissionSpec = field(
        "Load shedding (429/503 with Retry-After) from the workers' queues.", AdmissionSpec()
    )
    response_cache: ResponseCacheSpec = field(
        "Answers of repeated deterministic requests (the router's --response-cache).",
        ResponseCacheSpec(),
    )
    rate_limits: RateLimitsSpec = field(
        "Limits per model, per client IP and for the whole gateway (429 past one).",
        RateLimitsSpec(),
    )
    circuit_breaker: CircuitBreakerSpec = field(
        "Stop sending to failing workers and pools for a while.", CircuitBreakerSpec()
    )
    batch: BatchSpec = field("The OpenAI Batch API's storage and limits.", BatchSpec())
    node_selector: dict[str, str] = field("Node labels the router pods require.", {})
    tolerations: list[JsonObject] = field("Router pod tolerations.", [])
