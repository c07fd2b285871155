"""A gateway's semantic cache and limits, as the InferenceGateway and its InferenceModels say
them, reach `kvflow router` (its own parsers read the rendered config and command line),
and what the router would refuse is left out and reported instead of crash-looping it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import from_json
from kvflow.operator.api.v1alpha1_semantic_cache import (
    ROUTER_EMBED_TIMEOUT_S,
    ROUTER_MAX_ENTRIES_PER_SCOPE,
    ROUTER_MAX_MIB,
    ROUTER_SIMILARITY_THRESHOLD,
    ROUTER_TTL_S,
)
from kvflow.operator.builders.gateway import GatewayRef, desired_gateway_children
from kvflow.operator.builders.gateway_models import ModelObject, Resolution, resolve
from kvflow.operator.builders.names import Images
from kvflow.operator.builders.router import CONFIG_KEY
from kvflow.router.caches.semantic_config import SemanticCacheConfig
from kvflow.router.cli import parse_args as parse_router_args
from kvflow.router.limits.levels import LevelLimits
from kvflow.router.settings import RouterSettings

GATEWAY = GatewayRef(name="front", namespace="ns", uid="uid-g", generation=1)
POOLS = {
    "chat-pool": from_json(v1alpha1.InferencePoolSpec, {"model": {"servedName": "smol"}}),
    "embed-pool": from_json(
        v1alpha1.InferencePoolSpec, {"model": {"servedName": "wordllama"}, "task": "embed"}
    ),
}


def model(name: str, pool: str, **spec: Any) -> ModelObject:
    data = {"gatewayRef": {"name": "front"}, "targets": [{"poolRef": {"name": pool}}], **spec}
    return ModelObject(name, from_json(gw.InferenceModelSpec, data))


CHAT = model("chat", "chat-pool", semanticCache={"similarityThreshold": 0.98})
EMBEDDER = model("embedder", "embed-pool")


def gateway(**spec: Any) -> gw.InferenceGatewaySpec:
    return from_json(gw.InferenceGatewaySpec, {"router": {"allowUnauthenticated": True}, **spec})


def rendered(
    spec: gw.InferenceGatewaySpec, models: list[ModelObject], tmp_path: Path
) -> tuple[RouterSettings, Resolution]:
    resolution = resolve(models, POOLS, semantic_cache=spec.semantic_cache)
    configmap, _, deployment, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, POOLS
    )
    path = tmp_path / CONFIG_KEY
    path.write_text(configmap["data"][CONFIG_KEY])
    (router,) = deployment["spec"]["template"]["spec"]["containers"]
    args = [str(path) if a.endswith("/" + CONFIG_KEY) else a for a in router["args"][1:]]
    settings = parse_router_args(args, env={})
    assert settings is not None
    return settings, resolution


def test_the_semantic_cache_reaches_the_router(tmp_path: Path) -> None:
    spec = gateway(semanticCache={"embeddingModel": "embedder", "ttlSeconds": 60,
                                  "similarityThreshold": 0.95, "maxEntriesPerScope": 32,
                                  "maxMiB": 8, "embedTimeoutSeconds": 0.5})  # fmt: skip
    settings, resolution = rendered(spec, [CHAT, EMBEDDER], tmp_path)
    assert resolution.problems == ()
    assert settings.config.semantic_cache == SemanticCacheConfig(
        embedding_model="embedder", threshold=0.95, ttl_s=60.0, max_entries_per_scope=32,
        max_mib=8.0, embed_timeout_s=0.5, models={"chat": 0.98},
    )  # fmt: skip
    assert settings.config.semantic_cache.is_enabled


def test_the_gateways_semantic_cache_defaults_are_the_routers(tmp_path: Path) -> None:
    opted = model("chat", "chat-pool", semanticCache={})
    spec = gateway(semanticCache={"embeddingModel": "embedder"})
    settings, _ = rendered(spec, [opted, EMBEDDER], tmp_path)
    got = settings.config.semantic_cache
    router = SemanticCacheConfig()
    theirs = (router.threshold, router.ttl_s, router.max_entries_per_scope, router.max_mib,
              router.embed_timeout_s)  # fmt: skip
    ours = (ROUTER_SIMILARITY_THRESHOLD, ROUTER_TTL_S, ROUTER_MAX_ENTRIES_PER_SCOPE,
            ROUTER_MAX_MIB, ROUTER_EMBED_TIMEOUT_S)  # fmt: skip
    assert ours == theirs
    assert (got.threshold, got.ttl_s, got.max_entries_per_scope, got.max_mib,
            got.embed_timeout_s) == theirs  # fmt: skip
    assert dict(got.models) == {"chat": router.threshold}


def test_an_embedding_model_that_generates_is_left_out_and_reported(tmp_path: Path) -> None:
    """The router would refuse the section and never start; the gateway serves the models
    without the cache and its status says why."""
    spec = gateway(semanticCache={"embeddingModel": "chat"})
    settings, resolution = rendered(spec, [CHAT, EMBEDDER], tmp_path)
    assert not settings.config.semantic_cache.is_enabled
    assert [p.reason for p in resolution.problems] == ["EmbeddingModelUnavailable"]
    assert "does not target pools with task embed" in resolution.problems[0].message


def test_an_unknown_embedding_model_is_reported(tmp_path: Path) -> None:
    spec = gateway(semanticCache={"embeddingModel": "nope"})
    settings, resolution = rendered(spec, [CHAT, EMBEDDER], tmp_path)
    assert not settings.config.semantic_cache.is_enabled
    assert "is not a model this gateway serves" in resolution.problems[0].message


def test_an_opt_in_without_the_gateways_cache_is_reported(tmp_path: Path) -> None:
    settings, resolution = rendered(gateway(), [CHAT, EMBEDDER], tmp_path)
    assert not settings.config.semantic_cache.is_enabled
    assert [p.reason for p in resolution.problems] == ["SemanticCacheOff"]


def test_an_embedder_opting_in_is_left_out(tmp_path: Path) -> None:
    embedder = model("embedder", "embed-pool", semanticCache={})
    spec = gateway(semanticCache={"embeddingModel": "embedder"})
    settings, resolution = rendered(spec, [CHAT, embedder], tmp_path)
    assert dict(settings.config.semantic_cache.models) == {"chat": 0.98}
    assert [p.reason for p in resolution.problems] == ["SemanticCacheOnEmbedder"]


def test_a_gateways_limits_and_breaker_reach_its_router(tmp_path: Path) -> None:
    spec = gateway(router={
        "allowUnauthenticated": True,
        "rateLimits": {"global": {"maxInFlight": 100},
                       "models": [{"name": "chat", "requestsPerMinute": 60}]},
        "circuitBreaker": {"minRequests": 3},
    })  # fmt: skip
    settings, _ = rendered(spec, [CHAT, EMBEDDER], tmp_path)
    limits = settings.config.rate_limits
    assert limits.global_limits == LevelLimits(max_in_flight=100)
    assert dict(limits.models) == {"chat": LevelLimits(requests_per_minute=60)}
    assert settings.breaker.min_requests == 3
