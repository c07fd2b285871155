"""The semantic cache's service with a stand-in embedding (a paraphrase hits, a near miss
misses, the threshold is the model's, no answer crosses tenants, versions or contexts, the
TTL, the opt-ins and opt-outs) and its config section's parsing and refusals. The pure
parts: test_semantic_cache.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest
from testkit.semantic_cache import VERSION, chat, unit

from kvflow.router.caches.key import ModelVersion
from kvflow.router.caches.semantic_config import (
    DEFAULT_THRESHOLD,
    SemanticCacheConfig,
    parse_semantic_cache,
)
from kvflow.router.caches.semantic_service import SemanticCache
from kvflow.router.config_fields import ConfigError
from kvflow.router.protocol.requests import parse_chat_request
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.settings import parse_config
from kvflow.router.tenants.config import Quotas, Tenant, TenantConfigError, parse_tenants


def tenant(name: str, *, semantic: bool = True) -> Tenant:
    return Tenant(name, None, 0, Quotas(), cache_salt=name, semantic_cache=semantic)


# --- the service, with a stand-in embedding ------------------------------------------------

# Texts the stand-in embeds; the paraphrase's angle to the question is small.
VECTORS = {
    "What is the capital of France?": unit(0.0),
    "Which city is the capital of France?": unit(0.05),  # cos 0.9988
    "What is the capital of Germany?": unit(0.6),  # cos 0.825
}


async def embed(text: str) -> Sequence[float]:
    return VECTORS[text]


async def answer_stream(text: str) -> AsyncGenerator[ChoiceDelta | ChoiceUsage]:
    yield ChoiceDelta(index=0, text=text, finish_reason="stop")
    yield ChoiceUsage(0, 0, UsageCounts(5, 1, 0))


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def service(clock: Clock | None = None, **config: Any) -> SemanticCache:
    settings = SemanticCacheConfig(
        embedding_model="embedder", models={"m": config.pop("threshold", 0.99)}, **config
    )
    return SemanticCache(settings, embed, clock=clock or Clock())


async def ask(
    cache: SemanticCache,
    text: str,
    who: Tenant,
    *,
    version: ModelVersion = VERSION,
    headers: dict[str, str] | None = None,
    store: str | None = None,
    **extra: Any,
) -> Any:
    parsed = parse_chat_request(chat(text, **extra))
    ticket = await cache.look_up(headers or {}, parsed, parsed.sampling, who, version)
    if store is not None:
        async for _ in ticket.recording(answer_stream(store), 1):
            pass
    return ticket


def test_a_paraphrase_hits_and_a_near_miss_misses() -> None:
    async def run() -> None:
        cache, a = service(), tenant("a")
        first = await ask(cache, "What is the capital of France?", a, store="Paris")
        assert first.header() == "miss"
        hit = await ask(cache, "Which city is the capital of France?", a)
        assert hit.is_hit and hit.header() == "hit; similarity=1.00"
        replayed = [item async for item in hit.replay()]
        assert replayed[0].text == "Paris"
        assert replayed[1].usage.cached_tokens == 5  # every prompt token counts as cached
        # Its usage counts this request's prompt, not the stored one's.
        recounted = [item async for item in hit.replay([7])]
        assert recounted[1].usage.prompt_tokens == recounted[1].usage.cached_tokens == 7
        assert recounted[1].usage.completion_tokens == 1
        near_miss = await ask(cache, "What is the capital of Germany?", a)
        assert near_miss.header() == "miss" and not near_miss.is_hit

    asyncio.run(run())


def test_the_threshold_is_the_models() -> None:
    async def run() -> None:
        cache = service(threshold=0.9999)
        await ask(cache, "What is the capital of France?", tenant("a"), store="Paris")
        miss = await ask(cache, "Which city is the capital of France?", tenant("a"))
        assert miss.header() == "miss"

    asyncio.run(run())


def test_no_answer_crosses_tenants_versions_or_contexts() -> None:
    async def run() -> None:
        cache = service()
        await ask(cache, "What is the capital of France?", tenant("a"), store="Paris")
        same = "What is the capital of France?"
        assert not (await ask(cache, same, tenant("b"))).is_hit
        changed = ModelVersion(VERSION.pool, "another-model", VERSION.template)
        assert not (await ask(cache, same, tenant("a"), version=changed)).is_hit
        template = ModelVersion(VERSION.pool, VERSION.model, "another-template")
        assert not (await ask(cache, same, tenant("a"), version=template)).is_hit
        system = [{"role": "system", "content": "Be terse."}]
        assert not (await ask(cache, same, tenant("a"), before=system)).is_hit
        assert (await ask(cache, same, tenant("a"))).is_hit

    asyncio.run(run())


def test_entries_expire_after_the_ttl() -> None:
    async def run() -> None:
        clock = Clock()
        cache = service(clock, ttl_s=60.0)
        await ask(cache, "What is the capital of France?", tenant("a"), store="Paris")
        clock.now_s += 59
        assert (await ask(cache, "What is the capital of France?", tenant("a"))).is_hit
        clock.now_s += 2
        assert not (await ask(cache, "What is the capital of France?", tenant("a"))).is_hit

    asyncio.run(run())


@pytest.mark.parametrize(
    ("headers", "who", "extra", "reason"),
    [
        ({"x-kvflow-cache": "off"}, tenant("a"), {}, "header"),
        ({"cache-control": "no-store"}, tenant("a"), {}, "no_store"),
        ({}, tenant("a", semantic=False), {}, "tenant"),
        ({}, tenant("a"), {"temperature": 0.7}, "temperature"),
    ],
)
def test_opt_outs_and_sampled_requests_bypass(
    headers: dict[str, str], who: Tenant, extra: dict[str, Any], reason: str
) -> None:
    async def run() -> None:
        cache = service()
        await ask(cache, "What is the capital of France?", tenant("a"), store="Paris")
        ticket = await ask(cache, "What is the capital of France?", who, headers=headers,
                           store="Lyon", **extra)  # fmt: skip
        assert ticket.header() == "bypass" and not ticket.is_hit
        assert cache.metrics.bypasses.labels(reason)._value.get() == 1
        # Nothing was stored by the bypassed request: the first answer still replays.
        again = await ask(cache, "What is the capital of France?", tenant("a"))
        assert [i.text async for i in again.replay() if isinstance(i, ChoiceDelta)] == ["Paris"]

    asyncio.run(run())


def test_a_model_not_opted_in_and_a_failing_embedding_are_not_hits() -> None:
    async def run() -> None:
        cache = service()
        parsed = parse_chat_request({**chat("What is the capital of France?"), "model": "x"})
        off = await cache.look_up({}, parsed, parsed.sampling, tenant("a"), VERSION)
        assert off.header() is None
        unknown = await ask(cache, "never embedded", tenant("a"))  # the stand-in raises
        assert unknown.header() == "miss" and unknown.pending is None
        assert cache.metrics.errors.labels("embed")._value.get() == 1

    asyncio.run(run())


# --- config ---------------------------------------------------------------------------------

PUBLIC = {"chat", "embedder", "small", "large"}


def test_the_config_section_parses_with_the_measured_default_threshold() -> None:
    raw = {"embedding_model": "embedder", "models": {"chat": {}, "small": {"threshold": 0.99}}}
    config = parse_semantic_cache(raw, PUBLIC)
    assert config.is_enabled and config.embedding_model == "embedder"
    assert config.threshold_of("chat") == DEFAULT_THRESHOLD == 0.97
    assert config.threshold_of("small") == 0.99 and config.threshold_of("large") is None
    assert not parse_semantic_cache(None, PUBLIC).is_enabled


@pytest.mark.parametrize(
    ("raw", "generating", "says"),
    [
        ({"embedding_model": "chat", "models": {"chat": {}}}, (), "generates text"),
        ({"embedding_model": "large", "models": {"chat": {}}}, ("large",), "generates text"),
        ({"embedding_model": "nope", "models": {"chat": {}}}, (), "not a model this gateway"),
        ({"embedding_model": "embedder", "models": {"nope": {}}}, (), "not a model this gateway"),
        ({"embedding_model": "embedder", "threshold": 1.5}, (), "threshold must be > 0"),
        ({"embedding_model": "embedder", "max_entries_per_scope": 0}, (), "positive integer"),
        ({"embedding_model": "embedder", "color": 1}, (), "unknown fields"),
    ],
)
def test_the_config_is_refused_with_a_clear_error(
    raw: dict[str, Any], generating: tuple[str, ...], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_semantic_cache(raw, PUBLIC, generating)


def test_without_pools_the_section_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs a pools section"):
        parse_semantic_cache({"embedding_model": "embedder", "models": {"chat": {}}}, None)


def test_tenants_opt_in_and_are_out_by_default() -> None:
    digest = "0" * 64
    tenants = parse_tenants([
        {"name": "a", "api_key_sha256": digest, "semantic_cache": True},
        {"name": "b", "api_key_sha256": "1" * 64},
    ])  # fmt: skip
    by_name = tenants.tenants
    assert by_name["a"].semantic_cache and not by_name["b"].semantic_cache
    with pytest.raises(TenantConfigError, match="semantic_cache must be true or false"):
        parse_tenants([{"name": "a", "api_key_sha256": digest, "semantic_cache": "yes"}])


# --- the whole config file ------------------------------------------------------------------

POOLS = [
    {"name": "embed", "served_model_name": "embedder", "workers": ["127.0.0.1:1"]},
    {"name": "gen", "served_model_name": "chat", "workers": ["127.0.0.1:2"]},
    {"name": "gen2", "served_model_name": "large", "workers": ["127.0.0.1:3"]},
]


def test_the_config_file_carries_the_section() -> None:
    raw = {"pools": POOLS, "semantic_cache": {"embedding_model": "embedder",
                                              "models": {"chat": {}}}}  # fmt: skip
    config = parse_config(raw).semantic_cache
    assert config.embedding_model == "embedder" and config.threshold_of("chat") == 0.97
    assert not parse_config({"pools": POOLS}).semantic_cache.is_enabled


def test_the_config_file_is_refused_when_it_names_a_generating_model() -> None:
    models = [{"name": "assistant", "targets": [{"pool": "gen"}]}]
    cascade = {"assistant": {"small": "chat", "large": "large"}}
    raw = {"pools": POOLS, "models": models, "cascade": cascade,
           "semantic_cache": {"embedding_model": "large", "models": {"chat": {}}}}  # fmt: skip
    with pytest.raises(ConfigError, match="'large' generates text"):
        parse_config(raw)
