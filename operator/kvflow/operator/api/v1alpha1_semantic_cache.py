"""The semantic cache, version v1alpha1 (docs/router.md, "Semantic cache"): near-match
answers, on a gateway (InferenceGateway) only.

The router embeds a prompt with an embedding model it serves by name, so the cache needs a
gateway whose InferenceModels include one that targets an embedding pool (an InferencePool
with task embed); a pool's own router serves one model and cannot. The gateway's owner
turns it on and names the embedding model (SemanticCacheSpec); each model's owner opts in
on the InferenceModel (ModelSemanticCache); each tenant opts in too, in the tenants Secret
(`semantic_cache: true`). builders/gateway_semantic.py renders the router's
`semantic_cache:` section and reports what it must leave out. Pure: imports neither kopf
nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import field

# The router's defaults (kvflow.router.caches.semantic_config).
ROUTER_SIMILARITY_THRESHOLD = 0.97
ROUTER_TTL_S = 300.0
ROUTER_MAX_ENTRIES_PER_SCOPE = 256
ROUTER_MAX_MIB = 32.0
ROUTER_EMBED_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SemanticCacheSpec:
    """A gateway's semantic cache: a deterministic request whose prompt embeds within
    similarityThreshold of a stored one's (same tenant, model and sampling) gets the stored
    answer, for the models and tenants that opt in."""

    embedding_model: str = field(
        """The public model name (an InferenceModel's modelName on this gateway) whose
        target pools have task embed.""",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
    )
    similarity_threshold: float = field(
        """Cosine similarity at or above which a stored answer is replayed; a model's own
        semanticCache.similarityThreshold overrides it.""",
        ROUTER_SIMILARITY_THRESHOLD,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    ttl_seconds: float = field(
        "How long an entry is kept.", ROUTER_TTL_S, minimum=0, exclusive_minimum=True,
        maximum=86400,
    )  # fmt: skip
    max_entries_per_scope: int = field(
        "The newest entries kept per tenant, model and sampling (each look-up scans them).",
        ROUTER_MAX_ENTRIES_PER_SCOPE,
        minimum=1,
        maximum=65536,
    )
    max_mib: float = field(
        "The in-process store's size in MiB over all scopes, used without router.redis.",
        ROUTER_MAX_MIB,
        json_name="maxMiB",
        minimum=0,
        exclusive_minimum=True,
        maximum=65536,
    )
    embed_timeout_seconds: float = field(
        "An embedding slower than this is a miss (the request goes to the model).",
        ROUTER_EMBED_TIMEOUT_S,
        minimum=0,
        exclusive_minimum=True,
        maximum=60,
    )


@dataclass(frozen=True)
class ModelSemanticCache:
    """This model's opt-in to its gateway's semantic cache."""

    similarity_threshold: float | None = field(
        "This model's threshold; unset: the gateway's semanticCache.similarityThreshold.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
