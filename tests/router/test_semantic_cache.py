"""The semantic cache's pure parts: similarity, the number guard and the nearest match;
what is compared by meaning and what must be equal (the scope); the in-process store's
bounds and purge. The service and its config: test_semantic_cache_service.py."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from testkit.semantic_cache import VERSION, chat, unit

from kvflow.router.caches.key import ModelVersion, TenantScope
from kvflow.router.caches.semantic import (
    Candidate,
    cosine,
    nearest,
    numbers_in,
    query_of,
    scope_key,
    scope_prefix,
)
from kvflow.router.caches.semantic_store import (
    Entry,
    MemoryVectorStore,
    decode_entry,
    encode_entry,
)
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request

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
