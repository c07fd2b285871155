"""The semantic cache on the request path (docs/router.md, "Semantic cache"): a request whose
last user message means nearly the same as one answered before, in the same scope
(caches/semantic.py), gets that answer replayed.

It decides with the exact cache's policy (caches/policy.py: deterministic requests only,
the same opt-outs), and replays and records with the exact cache's answer format
(caches/answer.py). An embedding or a store that fails is a miss, counted and logged:
the semantic cache never fails a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from redis.asyncio import Redis

from kvflow.router.caches.answer import CachedAnswer, Item, decode, encode, replay, storable
from kvflow.router.caches.key import ModelVersion, TenantScope
from kvflow.router.caches.lookup_metrics import LookupCounters
from kvflow.router.caches.policy import BYPASS_REASONS, decide
from kvflow.router.caches.semantic import (
    Candidate,
    nearest,
    numbers_in,
    query_of,
    scope_key,
    scope_prefix,
)
from kvflow.router.caches.semantic_config import SemanticCacheConfig
from kvflow.router.caches.semantic_store import (
    Entry,
    MemoryVectorStore,
    RedisVectorStore,
    VectorStore,
    encode_entry,
    live,
)
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest, SamplingOptions
from kvflow.router.serving.types import ChoiceUsage
from kvflow.router.tenants.config import Tenant

log = logging.getLogger("kvflow.router.semantic_cache")

# The response header saying what the semantic cache did: hit (with the similarity), miss,
# bypass.
SEMANTIC_HEADER = "x-kvflow-semantic-cache"
# A larger answer is not stored.
MAX_ENTRY_BYTES = 256 * 1024
# Why a request skips the semantic cache: the exact cache's reasons, and a request with no
# last user message to compare (a completion, a tool result last).
SEMANTIC_BYPASS_REASONS = (*BYPASS_REASONS, "not_a_question")

# The text's embedding, unit length; raises on failure.
EmbedFn = Callable[[str], Awaitable[Sequence[float]]]


class SemanticCacheMetrics(LookupCounters):
    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = "kvflow_router_semantic_cache_"
        super().__init__(
            registry,
            prefix,
            lookups_help="Requests to opted-in models by what the semantic cache did: hit, "
            "miss or bypass",
            bypasses_help="Requests that skipped the semantic cache, by why",
            bypass_reasons=SEMANTIC_BYPASS_REASONS,
        )
        self.stores = Counter(prefix + "stores", "Answers stored", registry=registry)
        self.errors = Counter(
            prefix + "errors",
            "Operations that failed (embed, get, put): a miss or a skipped store",
            ["op"],
            registry=registry,
        )
        for op in ("embed", "get", "put"):
            self.errors.labels(op)


@dataclass(frozen=True)
class Pending:
    """What a miss stores once its answer has completed."""

    scope: str
    numbers: tuple[str, ...]
    vector: tuple[float, ...]


@dataclass(frozen=True)
class SemanticTicket:
    """What the semantic cache did for one request; ``result`` None: not in play (no
    header: the model or the gateway has it off)."""

    result: str | None = None
    similarity: float | None = None
    answer: CachedAnswer | None = None  # a hit's
    pending: Pending | None = None  # a miss that may be stored
    cache: SemanticCache | None = field(default=None, repr=False, compare=False)

    @property
    def is_hit(self) -> bool:
        return self.answer is not None

    def header(self) -> str | None:
        if self.result == "hit" and self.similarity is not None:
            return f"hit; similarity={self.similarity:.2f}"
        return self.result

    def replay(self, prompt_tokens: Sequence[int] | None = None) -> AsyncGenerator[Item]:
        """The stored answer; ``prompt_tokens``: this request's, per prompt. A near match's
        prompt is not the stored one's: its usage counts this request's prompt (all of it
        cached), not the other's."""
        assert self.answer is not None
        if prompt_tokens is None:
            return replay(self.answer)
        return replay(with_prompt_tokens(self.answer, prompt_tokens))

    def recording(self, stream: AsyncGenerator[Item], num_choices: int) -> AsyncGenerator[Item]:
        if self.pending is None or self.cache is None or self.is_hit:
            return stream
        return self.cache.record(self.pending, stream, num_choices)


SEMANTIC_OFF = SemanticTicket()


def with_prompt_tokens(answer: CachedAnswer, prompt_tokens: Sequence[int]) -> CachedAnswer:
    """``answer`` with each prompt's token count set to ``prompt_tokens``'s."""

    def count(prompt_index: int, stored: int) -> int:
        return prompt_tokens[prompt_index] if prompt_index < len(prompt_tokens) else stored

    items: list[Item] = []
    for item in answer.items:
        if isinstance(item, ChoiceUsage):
            n = count(item.prompt_index, item.usage.prompt_tokens)
            usage = dataclasses.replace(item.usage, prompt_tokens=n, cached_tokens=n)
            items.append(dataclasses.replace(item, usage=usage))
        elif item.num_prompt_tokens:
            # A choice's delta carries its prompt's count (protocol/responses.py): choices of a
            # chat request all answer its one prompt.
            items.append(dataclasses.replace(item, num_prompt_tokens=count(0, 0)))
        else:
            items.append(item)
    return CachedAnswer(tuple(items))


class SemanticCache:
    def __init__(
        self,
        config: SemanticCacheConfig,
        embed: EmbedFn | None = None,
        store: VectorStore | None = None,
        registry: CollectorRegistry | None = None,
        namespace: str = "default",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.embed = embed
        self.store = store or MemoryVectorStore(config.max_entries_per_scope, config.max_bytes)
        self.metrics = SemanticCacheMetrics(registry or CollectorRegistry())
        self.namespace = namespace
        self._clock = clock

    def applies_to(self, model: str) -> bool:
        return self.config.is_enabled and self.config.threshold_of(model) is not None

    async def look_up(
        self,
        headers: Mapping[str, str],
        parsed: ChatRequest | CompletionRequest,
        sampling: SamplingOptions,
        tenant: Tenant,
        version: ModelVersion,
        user: str | None = None,
    ) -> SemanticTicket:
        """As the exact cache's look_up (caches/service.py): ``sampling`` with the pool's
        defaults, ``version`` the answering pool's, ``user`` the prompt_cache_key."""
        threshold = self.config.threshold_of(parsed.model)
        if not self.config.is_enabled or threshold is None or self.embed is None:
            return SEMANTIC_OFF
        decision = decide(headers, sampling, tenant_allows=tenant.semantic_cache)
        query = query_of(parsed, sampling)
        bypass = decision.bypass or (None if query is not None else "not_a_question")
        if bypass is not None:
            self.metrics.count_bypass(bypass)
            return SemanticTicket("bypass")
        assert query is not None
        scope = scope_key(self.namespace, TenantScope(tenant.name, user), version, query.context)
        try:
            async with asyncio.timeout(self.config.embed_timeout_s):
                vector = tuple(await self.embed(query.text))
        except Exception as exc:  # no embedding: a miss, not stored
            self.metrics.errors.labels("embed").inc()
            self.metrics.lookups.labels("miss").inc()
            log.warning("semantic cache: embedding failed (%s); answering without it", exc)
            return SemanticTicket("miss")
        numbers = numbers_in(query.text)
        if decision.is_lookup:
            hit = await self._find(scope, Candidate(vector, numbers), threshold)
            if hit is not None:
                self.metrics.lookups.labels("hit").inc()
                return SemanticTicket("hit", hit[1], hit[0])
        self.metrics.lookups.labels("miss").inc()
        pending = Pending(scope, numbers, vector) if decision.is_store else None
        return SemanticTicket("miss", pending=pending, cache=self)

    async def _find(
        self, scope: str, query: Candidate, threshold: float
    ) -> tuple[CachedAnswer, float] | None:
        try:
            entries = live(await self.store.entries(scope), self._clock())
        except Exception as exc:
            self.metrics.errors.labels("get").inc()
            log.warning("semantic cache: lookup failed (%s); answering without it", exc)
            return None
        candidates = [Candidate(e.vector, e.numbers) for e in entries]
        match = nearest(query, candidates, threshold)
        if match is None:
            return None
        try:
            data = await self.store.answer(scope, entries[match.index].answer_id)
        except Exception as exc:
            self.metrics.errors.labels("get").inc()
            log.warning("semantic cache: lookup failed (%s); answering without it", exc)
            return None
        answer = None if data is None else decode(data)  # gone: trimmed, expired
        return None if answer is None else (answer, match.similarity)

    async def record(
        self, pending: Pending, stream: AsyncGenerator[Item], num_choices: int
    ) -> AsyncGenerator[Item]:
        """Pass ``stream`` through; once it has ended normally, store it under the scope."""
        items: list[Item] = []
        try:
            async for item in stream:
                items.append(item)
                yield item
        finally:
            await stream.aclose()
        answer = storable(items, num_choices)
        if answer is None:
            return
        data = encode(answer)
        if len(data) > MAX_ENTRY_BYTES:
            return
        ttl_s = self.config.ttl_s
        answer_id = uuid.uuid4().hex
        entry = Entry(self._clock() + ttl_s, pending.numbers, pending.vector, answer_id)
        try:
            await self.store.push(pending.scope, encode_entry(entry), answer_id, data, ttl_s)
        except Exception as exc:
            self.metrics.errors.labels("put").inc()
            log.warning("semantic cache: store failed (%s)", exc)
            return
        self.metrics.stores.inc()

    async def purge(self, pool: str | None = None, tenant: str | None = None) -> int:
        """Delete the entries of a pool (and a tenant of it), or all; returns how many."""
        if tenant is not None and pool is None:
            raise ValueError("a tenant's entries are purged per pool")
        return await self.store.purge(scope_prefix(self.namespace, pool, tenant))


def build_semantic_cache(
    config: SemanticCacheConfig,
    embed: EmbedFn | None,
    redis: Redis | None,
    registry: CollectorRegistry,
    namespace: str,
) -> SemanticCache:
    """In the gateway's Redis when it has one (replicas share the entries), else in process."""
    store = (
        RedisVectorStore(redis, config.max_entries_per_scope)
        if redis is not None and config.is_enabled
        else None
    )
    return SemanticCache(config, embed, store, registry, namespace)
