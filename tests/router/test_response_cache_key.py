"""The response cache's pure parts: what changes a key and what does not, which requests
may be cached, the stored answer's round trip, and the in-process store's bounds."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvflow.proto import worker_pb2 as pb
from kvflow.router.caches.answer import CachedAnswer, decode, encode, storable
from kvflow.router.caches.key import (
    ModelVersion,
    TenantScope,
    cache_key,
    model_version,
    request_fingerprint,
    tenant_of,
    tenant_user,
)
from kvflow.router.caches.policy import Decision, decide, greedy_twin
from kvflow.router.caches.stores import MemoryAnswerStore
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.protocol.responses import ChoiceDelta, ToolCallDelta, UsageCounts
from kvflow.router.serving.defaults import apply_sampling_defaults
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.text.generation_config import SamplingDefaults

BASE: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "temperature": 0,
    "max_tokens": 8,
}
INFO = pb.WorkerInfo(
    model="m", hash_seed=b"\x01" * 16, vocab_size=100, max_model_len=512, eos_token_ids=[2]
)
VERSION = model_version("pool-a", "m", INFO, "{{ messages }}")


def key_of(
    body: dict[str, Any],
    *,
    tenant: str = "a",
    version: ModelVersion = VERSION,
    user: str | None = None,
    namespace: str = "default",
) -> str:
    parsed = parse_chat_request(body)
    fingerprint = request_fingerprint(parsed, parsed.sampling)
    return cache_key(namespace, TenantScope(tenant, user), version, fingerprint)


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": "hi!"}]},
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]},
        {"max_tokens": 9},
        {"temperature": 0.5, "seed": 1},
        {"stop": ["x"]},
        {"presence_penalty": 1},
        {"logit_bias": {"5": 1}},
        {"n": 2, "seed": 1},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"chat_template_kwargs": {"enable_thinking": False}},
    ],
)
def test_what_the_model_sees_changes_the_key(change: dict[str, Any]) -> None:
    assert key_of({**BASE, **change}) != key_of(BASE)


@pytest.mark.parametrize(
    "change",
    [
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"model": "an-alias-of-the-same-pool"},
        {"user": "someone"},
        {"metadata": {"a": "b"}},
    ],
)
def test_the_wire_format_and_the_model_alias_do_not(change: dict[str, Any]) -> None:
    assert key_of({**BASE, **change}) == key_of(BASE)


SAMPLED: dict[str, Any] = {**BASE, "temperature": 0.7, "seed": 1}


@pytest.mark.parametrize(
    "change", [{"seed": 7}, {"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.1}, {"temperature": 0.8}]
)
def test_what_sampling_uses_changes_a_sampled_key(change: dict[str, Any]) -> None:
    assert key_of({**SAMPLED, **change}) != key_of(SAMPLED)


@pytest.mark.parametrize(
    "change",
    [{"seed": 7}, {"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.1},
     {"seed": 3, "top_p": 0.9, "top_k": 40, "min_p": 0.05}],
)  # fmt: skip
def test_what_greedy_decoding_ignores_does_not_change_a_greedy_key(
    change: dict[str, Any],
) -> None:
    """At temperature 0 the worker takes the most likely token: top_p, top_k, min_p and the
    seed change nothing, so every greedy request for the same input shares one answer."""
    assert key_of({**BASE, **change}) == key_of(BASE)
    # What greedy decoding does use still counts.
    assert key_of({**BASE, **change, "presence_penalty": 1}) != key_of(BASE)


def test_the_tenant_and_the_user_are_in_the_key() -> None:
    assert key_of(BASE, tenant="b") != key_of(BASE, tenant="a")
    assert key_of(BASE, user="u1") != key_of(BASE)
    assert key_of(BASE, user="u1") != key_of(BASE, user="u2")
    assert key_of(BASE, namespace="other") != key_of(BASE)
    # Readable prefixes select a pool's (and a tenant's) entries for a purge.
    assert key_of(BASE).startswith("kvflow:default:rcache:pool-a:a:")
    # The memory store's owner of a key: its tenant, whatever the user.
    assert tenant_of("default", key_of(BASE, tenant="b", user="u1")) == "b"
    assert tenant_of("other", key_of(BASE, tenant="a", namespace="other")) == "a"
    assert tenant_user({"prompt_cache_key": "u1"}) == "u1"
    assert tenant_user({"prompt_cache_key": {"b": 1}}) == '{"b":1}'
    assert tenant_user({}) is None


def test_the_model_and_template_versions_are_in_the_key() -> None:
    assert key_of(BASE, version=model_version("pool-b", "m", INFO, "{{ messages }}")) != key_of(
        BASE
    )
    for info in (
        pb.WorkerInfo(model="m", hash_seed=b"\x02" * 16, vocab_size=100, max_model_len=512),
        pb.WorkerInfo(model="m", hash_seed=b"\x01" * 16, vocab_size=101, max_model_len=512),
        pb.WorkerInfo(model="m", hash_seed=b"\x01" * 16, vocab_size=100, max_model_len=1024),
    ):
        changed = model_version("pool-a", "m", info, "{{ messages }}")
        assert changed.model != VERSION.model and key_of(BASE, version=changed) != key_of(BASE)
    assert key_of(BASE, version=model_version("pool-a", "m2", INFO, "{{ messages }}")) != key_of(
        BASE
    )
    new_template = model_version("pool-a", "m", INFO, "{{ messages }}!")
    assert new_template.model == VERSION.model and new_template.template != VERSION.template
    assert key_of(BASE, version=new_template) != key_of(BASE)
    # A worker's instance id (a restart) is not the model's version.
    restarted = pb.WorkerInfo()
    restarted.CopyFrom(INFO)
    restarted.instance_id = "new"
    assert model_version("pool-a", "m", restarted, "{{ messages }}") == VERSION


def test_defaults_are_applied_before_the_key() -> None:
    """A request leaving temperature out gets the pool's default: another default, another
    answer."""
    parsed = parse_chat_request({"model": "m", "messages": BASE["messages"]})
    cold = apply_sampling_defaults(parsed.sampling, SamplingDefaults(temperature=0.0))
    warm = apply_sampling_defaults(parsed.sampling, SamplingDefaults(temperature=0.7))
    assert request_fingerprint(parsed, cold) != request_fingerprint(parsed, warm)


def test_chat_and_completion_of_the_same_text_differ() -> None:
    chat = parse_chat_request(BASE)
    completion = parse_completion_request(
        {"model": "m", "prompt": "hi", "temperature": 0, "max_tokens": 8}
    )
    assert request_fingerprint(chat, chat.sampling) != request_fingerprint(
        completion, completion.sampling
    )


def _decide(
    body: dict[str, Any], headers: dict[str, str] | None = None, *, tenant_allows: bool = True
) -> str | None:
    decision = decide(headers or {}, parse_chat_request(body).sampling, tenant_allows=tenant_allows)
    return decision.bypass


def test_only_deterministic_requests_are_cached() -> None:
    assert _decide(BASE) is None
    assert _decide({**BASE, "temperature": 0.7}) == "temperature"
    assert _decide({k: v for k, v in BASE.items() if k != "temperature"}) == "temperature"
    assert _decide({**BASE, "temperature": 0.7, "seed": 3}) is None
    assert _decide({**BASE, "n": 2}) == "n"
    assert _decide({**BASE, "n": 2, "seed": 3}) is None
    assert _decide({**BASE, "logprobs": True}) == "logprobs"


def test_callers_and_tenants_opt_out() -> None:
    assert _decide(BASE, {"x-kvflow-cache": "off"}) == "header"
    assert _decide(BASE, {"x-kvflow-cache": "on"}) is None
    assert _decide(BASE, {"cache-control": "no-store"}) == "no_store"
    assert _decide(BASE, {"cache-control": "max-age=0, No-Store"}) == "no_store"
    assert _decide(BASE, tenant_allows=False) == "tenant"
    # no-cache: the stored answer is not used, the fresh one replaces it.
    refresh = decide(
        {"cache-control": "no-cache"}, parse_chat_request(BASE).sampling, tenant_allows=True
    )
    assert (refresh.is_lookup, refresh.is_store) == (False, True)


def test_under_the_response_cache_step_a_sampled_request_reads_its_greedy_twin() -> None:
    def under_step(
        body: dict[str, Any], headers: dict[str, str] | None = None, *, tenant_allows: bool = True
    ) -> Decision:
        sampling = parse_chat_request(body).sampling
        return decide(headers or {}, sampling, tenant_allows=tenant_allows, serves_sampled=True)

    sampled = {**BASE, "temperature": 0.7}
    twin = under_step(sampled)
    # Read, never stored: a sample is not the greedy answer its twin's key promises.
    assert twin.is_twin and (twin.is_lookup, twin.is_store) == (True, False)
    assert under_step({k: v for k, v in BASE.items() if k != "temperature"}).is_twin
    assert _decide(sampled) == "temperature"  # without the step: skipped as before
    # Several choices or logprobs: the twin's one greedy answer is not what was asked.
    assert under_step({**sampled, "n": 2}).bypass == "temperature"
    assert under_step({**sampled, "logprobs": True}).bypass == "temperature"
    assert under_step({**sampled, "logprobs": True, "top_logprobs": 2}).bypass == "temperature"
    # The caller's and the tenant's opt-outs still hold; no-cache would store the sample.
    assert under_step(sampled, {"x-kvflow-cache": "off"}).bypass == "header"
    assert under_step(sampled, {"cache-control": "no-store"}).bypass == "no_store"
    assert under_step(sampled, {"cache-control": "no-cache"}).bypass == "temperature"
    assert under_step(sampled, tenant_allows=False).bypass == "tenant"
    # A request the cache serves anyway is unchanged: looked up and stored as itself.
    for body in (BASE, {**sampled, "seed": 3}):
        decision = under_step(body)
        assert not decision.is_twin and (decision.is_lookup, decision.is_store) == (True, True)


def test_a_greedy_twin_keys_as_the_greedy_request() -> None:
    sampled = parse_chat_request({**BASE, "temperature": 0.7, "top_p": 0.9})
    greedy = parse_chat_request(BASE)
    assert request_fingerprint(sampled, greedy_twin(sampled.sampling)) == request_fingerprint(
        greedy, greedy.sampling
    )
    assert request_fingerprint(sampled, sampled.sampling) != request_fingerprint(
        greedy, greedy.sampling
    )


def _answer(reason: str | None = "stop") -> list[ChoiceDelta | ChoiceUsage]:
    return [
        ChoiceDelta(0, "Hel", num_prompt_tokens=5, num_completion_tokens=1),
        ChoiceDelta(
            0,
            "lo",
            finish_reason=reason,
            num_prompt_tokens=5,
            num_completion_tokens=2,
            tool_calls=(ToolCallDelta(0, "call_1", "f", '{"a":'),),
        ),
        ChoiceUsage(0, 0, UsageCounts(5, 2, 0)),
    ]


def test_an_answer_round_trips_and_replays_as_cached_prompt_tokens() -> None:
    answer = storable(_answer(), num_choices=1)
    assert answer is not None
    assert decode(encode(answer)) == answer
    replayed = answer.replayed()
    usage = replayed[-1]
    assert isinstance(usage, ChoiceUsage) and usage.usage == UsageCounts(5, 2, 5)
    assert answer.prompt_tokens == 5
    assert decode(b"not json") is None
    assert decode(b"[99, []]") is None


def test_unfinished_or_aborted_answers_are_not_storable() -> None:
    assert storable(_answer("abort"), num_choices=1) is None
    assert storable(_answer(None), num_choices=1) is None
    assert storable(_answer()[:-1], num_choices=1) is None  # no usage: cut short
    assert storable(_answer(), num_choices=2) is None  # a choice never finished
    assert storable(_answer("length"), num_choices=1) is not None


def test_memory_store_is_bounded_in_bytes_lru_and_expires() -> None:
    now = [0.0]
    evicted: list[int] = []

    async def run() -> None:
        store = MemoryAnswerStore(300, evicted.append, clock=lambda: now[0])
        for i in range(3):
            await store.put(f"k{i}", b"x" * 98, ttl_s=10)  # 100 bytes each with the key
        assert store.num_bytes == 300 and len(store) == 3
        assert await store.get("k0") == b"x" * 98  # k0 is now the most recently used
        await store.put("k3", b"y" * 98, ttl_s=10)
        assert evicted == [1]
        assert await store.get("k1") is None and await store.get("k0") is not None
        assert store.num_bytes <= store.max_bytes
        await store.put("huge", b"z" * 1000, ttl_s=10)  # never fits: not stored
        assert await store.get("huge") is None and len(store) == 3
        now[0] = 10.0
        assert await store.get("k0") is None  # expired
        assert await store.purge("k") == 2 and store.num_bytes == 0

    asyncio.run(run())


def test_the_tenant_holding_the_most_gives_up_its_oldest_first() -> None:
    """One tenant's entries never push out another's while that one holds less."""

    async def run() -> None:
        store = MemoryAnswerStore(1000, owner_of=lambda key: key.partition(":")[0])
        await store.put("a:00", b"a" * 96, ttl_s=10)  # 100 bytes with the key
        for i in range(20):  # b alone fills the store twice over
            await store.put(f"b:{i:02d}", b"b" * 96, ttl_s=10)
        assert await store.get("a:00") is not None
        assert store.bytes_of("a") == 100 and store.bytes_of("b") == 900
        assert await store.get("b:19") is not None and await store.get("b:10") is None
        # Once a holds more than b, its entries go first, oldest first.
        for i in range(1, 12):
            await store.put(f"a:{i:02d}", b"a" * 96, ttl_s=10)
        assert store.bytes_of("a") == 500 and store.bytes_of("b") == 500
        assert await store.get("a:00") is None and await store.get("a:11") is not None
        assert store.num_bytes == store.max_bytes
        # Deleted and purged entries leave their owner's count.
        assert await store.delete("a:11") and store.bytes_of("a") == 400
        assert await store.purge("b:") == 5 and store.bytes_of("b") == 0
        assert store.num_bytes == 400 and len(store) == 4

    asyncio.run(run())


def test_an_unknown_field_type_fails_loudly() -> None:
    """A value the key cannot see would make two requests collide: refuse it."""
    from kvflow.router.caches.key import _plain

    with pytest.raises(TypeError):
        _plain(object())
    assert isinstance(CachedAnswer(()).replayed(), list)


def test_flags_and_the_tenant_setting() -> None:
    from kvflow.router.cli import parse_args
    from kvflow.router.tenants.config import TenantConfigError, hash_api_key, parse_tenants

    default = parse_args([])
    assert default is not None and not default.response_cache.is_enabled  # off by default
    settings = parse_args(
        [
            "--response-cache",
            "on",
            "--response-cache-ttl-s",
            "5",
            "--response-cache-max-mib",
            "0.5",
            "--response-cache-max-entry-kib",
            "8",
        ]
    )
    assert settings is not None
    config = settings.response_cache
    assert (config.is_enabled, config.ttl_s, config.max_bytes, config.max_entry_bytes) == (
        True,
        5.0,
        512 * 1024,
        8 * 1024,
    )
    for bad in (
        ["--response-cache-ttl-s", "0"],
        ["--response-cache-max-mib", "-1"],
        ["--response-cache-max-entry-kib", "nan"],
        ["--response-cache", "yes"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    entry = {"name": "t", "api_key_sha256": hash_api_key("k")}
    assert parse_tenants([entry]).tenants["t"].response_cache
    assert not parse_tenants([{**entry, "response_cache": False}]).tenants["t"].response_cache
    with pytest.raises(TenantConfigError, match="response_cache"):
        parse_tenants([{**entry, "response_cache": "no"}])
