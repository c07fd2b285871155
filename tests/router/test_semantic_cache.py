"""The semantic cache's pure parts and its service with a stand-in embedding: what is
compared by meaning and what must be equal (the scope), the threshold and the number
guard, the bounds of the in-process store, the TTL, the opt-ins and opt-outs, and the
config's refusals."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from kvflow.proto import worker_pb2 as pb
from kvflow.router.caches.key import ModelVersion, TenantScope, model_version
from kvflow.router.caches.semantic import (
    Candidate,
    cosine,
    nearest,
    numbers_in,
    query_of,
    scope_key,
    scope_prefix,
)
from kvflow.router.caches.semantic_config import (
    DEFAULT_THRESHOLD,
    SemanticCacheConfig,
    parse_semantic_cache,
)
from kvflow.router.caches.semantic_service import SemanticCache
from kvflow.router.caches.semantic_store import (
    Entry,
    MemoryVectorStore,
    decode_entry,
    encode_entry,
)
from kvflow.router.config_fields import ConfigError
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.settings import parse_config
from kvflow.router.tenants.config import Quotas, Tenant, TenantConfigError, parse_tenants

INFO = pb.WorkerInfo(
    model="m", hash_seed=b"\x01" * 16, vocab_size=100, max_model_len=512, eos_token_ids=[2]
)
VERSION = model_version("pool-a", "m", INFO, "{{ messages }}")


def chat(text: str, **extra: Any) -> dict[str, Any]:
    messages = [*extra.pop("before", []), {"role": "user", "content": text}]
    return {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8, **extra}


def tenant(name: str, *, semantic: bool = True) -> Tenant:
    return Tenant(name, None, 0, Quotas(), cache_salt=name, semantic_cache=semantic)


# --- pure: similarity, numbers, nearest ---------------------------------------------------


def test_cosine() -> None:
    assert cosine([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 1.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [2.0, 2.0]) == pytest.approx(1.0)  # length does not matter
    assert cosine([1.0, 0.0], [1.0, 0.0, 0.0]) == 0.0  # another model's: never comparable
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0


def test_numbers_in() -> None:
    assert numbers_in("Convert 5 miles to km") == ("5",)
    assert numbers_in("15% of 2,000.5 in 2024") == ("15", "2,000.5", "2024")
    assert numbers_in("no numbers") == ()


def unit(angle: float) -> tuple[float, float]:
    return (math.cos(angle), math.sin(angle))


def test_nearest_takes_the_most_similar_at_or_above_the_threshold() -> None:
    query = Candidate(unit(0.0), ())
    far, near = Candidate(unit(0.5), ()), Candidate(unit(0.1), ())
    match = nearest(query, [far, near], threshold=0.99)
    assert match is not None and match.index == 1
    assert match.similarity == pytest.approx(math.cos(0.1))
    # Exactly at the threshold matches; just above it does not.
    assert nearest(query, [near], threshold=math.cos(0.1)) is not None
    assert nearest(query, [near], threshold=math.cos(0.1) + 1e-6) is None
    assert nearest(query, [], threshold=0.5) is None


def test_nearest_never_matches_other_numbers() -> None:
    query = Candidate(unit(0.0), ("5",))
    assert nearest(query, [Candidate(unit(0.0), ("50",))], threshold=0.5) is None
    assert nearest(query, [Candidate(unit(0.0), ())], threshold=0.5) is None
    assert nearest(query, [Candidate(unit(0.0), ("5",))], threshold=0.5) is not None


# --- pure: what is compared, what is scoped -----------------------------------------------


def query(body: dict[str, Any]) -> Any:
    parsed = parse_chat_request(body)
    return query_of(parsed, parsed.sampling)


def test_the_last_user_message_is_compared_and_the_rest_must_be_equal() -> None:
    a, b = query(chat("What is the capital of France?")), query(chat("Capital of France?"))
    assert a.text == "What is the capital of France?"
    assert a.context == b.context  # only the last message differs
    system = [{"role": "system", "content": "Answer in French."}]
    assert query(chat("Capital of France?", before=system)).context != b.context
    assert query(chat("Capital of France?", max_tokens=9)).context != b.context
    earlier = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert query(chat("Capital of France?", before=earlier)).context != b.context


def test_requests_without_a_last_user_question_are_not_compared() -> None:
    assert query(chat("   ")) is None
    last_assistant = {"model": "m", "temperature": 0, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]}  # fmt: skip
    assert query(last_assistant) is None
    completion = parse_completion_request({"model": "m", "prompt": "hi", "temperature": 0})
    assert query_of(completion, completion.sampling) is None


def test_the_scope_binds_tenant_user_model_and_template_version() -> None:
    base = scope_key("ns", TenantScope("a"), VERSION, "ctx")
    assert base.startswith("kvflow:ns:scache:pool-a:a:")
    others = [
        scope_key("ns", TenantScope("b"), VERSION, "ctx"),
        scope_key("ns", TenantScope("a", "user-1"), VERSION, "ctx"),
        scope_key("ns", TenantScope("a"), ModelVersion("pool-a", "other", VERSION.template), "ctx"),
        scope_key("ns", TenantScope("a"), ModelVersion("pool-a", VERSION.model, "t2"), "ctx"),
        scope_key("ns", TenantScope("a"), VERSION, "ctx2"),
        scope_key("other-ns", TenantScope("a"), VERSION, "ctx"),
    ]
    assert base not in others and len(set(others)) == len(others)


# --- the store ------------------------------------------------------------------------------


def test_an_entry_round_trips() -> None:
    entry = Entry(12.5, ("5",), (0.25, -0.5, 1.0), "answer-id")
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_entry(b"[9, 1]") is None and decode_entry(b"junk") is None


def test_the_memory_store_keeps_the_newest_entries_per_scope_and_its_bytes() -> None:
    async def run() -> None:
        # Each push: an entry of 10 bytes and an answer of 5.
        store = MemoryVectorStore(max_entries_per_scope=2, max_bytes=150)
        for i, value in enumerate((b"1" * 10, b"2" * 10, b"3" * 10)):
            await store.push("s", value, f"id{i}", b"a" * 5, 60)
        assert await store.entries("s") == [b"3" * 10, b"2" * 10]
        assert await store.answer("s", "id0") is None  # trimmed with its entry
        assert await store.answer("s", "id2") == b"a" * 5
        assert store.num_bytes == 30
        for scope in ("t", "u", "v", "w", "x"):  # 10 more pushes of 15: past 150 bytes
            await store.push(scope, b"a" * 10, "i", b"a" * 5, 60)
            await store.push(scope, b"b" * 10, "j", b"a" * 5, 60)
        assert store.num_bytes <= 150
        assert await store.entries("s") == []  # the least recently used scope went first
        assert await store.answer("s", "id2") is None

    asyncio.run(run())


def test_a_purge_drops_a_tenants_scopes_of_a_pool() -> None:
    async def run() -> None:
        store = MemoryVectorStore(max_entries_per_scope=4, max_bytes=1000)
        a = scope_key("ns", TenantScope("a"), VERSION, "ctx")
        b = scope_key("ns", TenantScope("b"), VERSION, "ctx")
        for i, scope in enumerate((a, a, b)):
            await store.push(scope, b"x" * 10, str(i), b"y" * 5, 60)
        assert await store.purge(scope_prefix("ns", "pool-a", "a")) == 2
        assert await store.entries(a) == [] and await store.entries(b) == [b"x" * 10]
        assert await store.answer(a, "0") is None and await store.answer(b, "2") == b"y" * 5
        assert store.num_bytes == 15
        assert await store.purge(scope_prefix("ns")) == 1 and store.num_bytes == 0

    asyncio.run(run())


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
