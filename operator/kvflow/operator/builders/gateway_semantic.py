"""A gateway's semantic cache: the router's `semantic_cache:` section from the gateway's
spec.semanticCache and its InferenceModels' opt-ins (pure).

The router refuses a section whose embedding model it does not serve by name or that also
generates (a degradation ladder's or a cascade's model, or one opted in), and a crash-looping
gateway serves nobody; an opt-in whose model embeds, or whose gateway has no semantic cache,
would never take effect. So each of these is left out and reported in the gateway's status
(gateway_models.GatewayProblem) instead. The router checks the embedding model's workers
only when it embeds, so an embedding model whose pools are not task embed is refused here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_gateway import InferenceModelSpec, ResolvedModel
from kvflow.operator.api.v1alpha1_semantic_cache import SemanticCacheSpec


def _embeds(model: ResolvedModel, pools: Mapping[str, v1alpha1.InferencePoolSpec]) -> bool:
    return all(pools[t.pool].task == "embed" for t in model.targets if t.weight > 0)


def semantic_cache_section(
    spec: SemanticCacheSpec | None,
    opt_ins: Mapping[str, InferenceModelSpec],
    resolved: Sequence[ResolvedModel],
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
    generating: Collection[str],
) -> tuple[dict[str, Json] | None, list[tuple[str, str]]]:
    """The section (None: left out) and the problems as (reason, message).

    `opt_ins`: InferenceModel object name -> spec, of the accepted models with a
    semanticCache. `generating`: public names the config's degradation and cascade name."""
    problems: list[tuple[str, str]] = []
    if spec is None:
        problems += [
            ("SemanticCacheOff", f"InferenceModel {name}: semanticCache needs the gateway's "
             "spec.semanticCache; the opt-in is left out")
            for name in sorted(opt_ins)
        ]  # fmt: skip
        return None, problems
    by_name = {m.name: m for m in resolved}
    embedder = by_name.get(spec.embedding_model)
    if embedder is None or not _embeds(embedder, pools):
        why = ("is not a model this gateway serves (an InferenceModel's modelName)"
               if embedder is None else "does not target pools with task embed")  # fmt: skip
        problems.append(("EmbeddingModelUnavailable",
                         f"semanticCache.embeddingModel {spec.embedding_model!r} {why}; the "
                         "semantic cache is off"))  # fmt: skip
        return None, problems
    if spec.embedding_model in generating:
        problems.append(("EmbeddingModelGenerates",
                         f"semanticCache.embeddingModel {spec.embedding_model!r} has a "
                         "degradation ladder or a cascade; the semantic cache is off"))  # fmt: skip
        return None, problems
    models: dict[str, Json] = {}
    for name, model_spec in sorted(opt_ins.items()):
        public = model_spec.model_name or name
        opt_in = model_spec.semantic_cache
        assert opt_in is not None
        target = by_name.get(public)
        if public == spec.embedding_model or (target is not None and _embeds(target, pools)):
            problems.append(("SemanticCacheOnEmbedder",
                             f"InferenceModel {name}: an embedding model's answers are not "
                             "cached; its semanticCache is left out"))  # fmt: skip
            continue
        threshold = opt_in.similarity_threshold
        models[public] = {} if threshold is None else {"threshold": threshold}
    if not models:
        return None, problems
    return {
        "embedding_model": spec.embedding_model,
        "threshold": spec.similarity_threshold,
        "ttl_s": spec.ttl_seconds,
        "max_entries_per_scope": spec.max_entries_per_scope,
        "max_mib": spec.max_mib,
        "embed_timeout_s": spec.embed_timeout_seconds,
        "models": models,
    }, problems
