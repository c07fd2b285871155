"""The response cache as the request path uses it: look a request up (a ticket saying hit,
miss or bypass), replay a hit, record a miss and store it once it has completed; purge.

A lookup or store that fails (Redis down, a timeout) is a miss or a skipped store, counted
and logged: the cache never fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.asyncio import Redis

from kvflow.router.caches.answer import CachedAnswer, Item, decode, encode, replay, storable
from kvflow.router.caches.config import ResponseCacheConfig
from kvflow.router.caches.key import (
    ModelVersion,
    TenantScope,
    cache_key,
    key_prefix,
    request_fingerprint,
    tenant_of,
)
from kvflow.router.caches.lookup_metrics import LookupCounters
from kvflow.router.caches.policy import (
    BYPASS_REASONS,
    RESULT_HEADER,
    Result,
    decide,
    greedy_twin,
)
from kvflow.router.caches.semantic_service import SEMANTIC_HEADER, SEMANTIC_OFF, SemanticTicket
from kvflow.router.caches.stores import AnswerStore, MemoryAnswerStore, RedisAnswerStore
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest, SamplingOptions
from kvflow.router.protocol.responses import ChoiceDelta
from kvflow.router.tenants.config import Tenant

log = logging.getLogger("kvflow.router.response_cache")

# Per recorded item, beyond its text: what a stored row costs (ids, counts, brackets).
_ROW_OVERHEAD_BYTES = 32


class ResponseCacheMetrics(LookupCounters):
    def __init__(self, registry: CollectorRegistry) -> None:
        prefix = "kvflow_router_response_cache_"
        super().__init__(
            registry,
            prefix,
            lookups_help="Requests by what the response cache did: hit, miss or bypass",
            bypasses_help="Requests that skipped the response cache, by why",
            bypass_reasons=BYPASS_REASONS,
        )
        self.twin_lookups = Counter(
            prefix + "twin_lookups",
            "Sampled requests looked up as their greedy twin under a model's response_cache "
            "degradation step, by result: hit or miss (also counted in lookups)",
            ["result"],
            registry=registry,
        )
        self.stores = Counter(prefix + "stores", "Answers stored", registry=registry)
        self.stored_bytes = Counter(
            prefix + "stored_bytes", "Bytes of the answers stored", registry=registry
        )
        self.skipped_stores = Counter(
            prefix + "skipped_stores",
            "Answers of cacheable requests not stored: unfinished (an error, an abort, a "
            "client gone), too_large, or a store that failed (error)",
            ["reason"],
            registry=registry,
        )
        self.evictions = Counter(
            prefix + "evictions",
            "Entries the in-process store evicted to stay within --response-cache-max-mib",
            registry=registry,
        )
        self.bytes = Gauge(
            prefix + "bytes", "Bytes the in-process store holds (0 with Redis)", registry=registry
        )
        self.errors = Counter(
            prefix + "errors", "Store operations that failed (get, put)", ["op"], registry=registry
        )
        for result in ("hit", "miss"):
            self.twin_lookups.labels(result)
        for reason in ("unfinished", "too_large", "error"):
            self.skipped_stores.labels(reason)


@dataclass(frozen=True)
class CacheTicket:
    """What the cache did for one request. ``result`` None: the cache is off (no header)."""

    result: Result | None = None
    key: str | None = None  # set when the fresh answer may be stored
    answer: CachedAnswer | None = None  # a hit's
    is_twin: bool = False  # looked up as its greedy twin (caches/policy.py): never stored
    cache: ResponseCache | None = field(default=None, repr=False, compare=False)
    # The semantic cache's, asked after an exact miss (caches/semantic_service.py).
    semantic: SemanticTicket = SEMANTIC_OFF

    @property
    def is_hit(self) -> bool:
        return self.answer is not None or self.semantic.is_hit

    def headers(self) -> dict[str, str]:
        found: dict[str, str] = {} if self.result is None else {RESULT_HEADER: self.result}
        semantic = self.semantic.header()
        return found if semantic is None else {**found, SEMANTIC_HEADER: semantic}

    def replay(self, prompt_tokens: Sequence[int] | None = None) -> AsyncGenerator[Item]:
        """The stored answer; ``prompt_tokens`` (this request's, per prompt) recount a
        near match's usage (caches/semantic_service.py); an exact hit's prompt is its own."""
        if self.answer is None:
            return self.semantic.replay(prompt_tokens)
        return replay(self.answer)

    def without_store(self) -> CacheTicket:
        """This ticket storing nothing: the answer will not be the one its key names (a
        degradation step capped the request's default max_tokens after the lookup)."""
        return replace(self, key=None, semantic=replace(self.semantic, pending=None))

    def recording(self, stream: AsyncGenerator[Item], num_choices: int) -> AsyncGenerator[Item]:
        """``stream``, stored once it has ended normally (by each cache that may store it);
        unchanged when nothing is to be stored."""
        if self.is_hit:
            return stream
        stream = self.semantic.recording(stream, num_choices)
        if self.key is None or self.cache is None:
            return stream
        return self.cache.record(self.key, stream, num_choices)


OFF = CacheTicket()


class ResponseCache:
    def __init__(
        self,
        config: ResponseCacheConfig,
        store: AnswerStore | None = None,
        registry: CollectorRegistry | None = None,
        namespace: str = "default",
    ) -> None:
        self.config = config
        self.metrics = ResponseCacheMetrics(registry or CollectorRegistry())
        if store is None:
            memory = MemoryAnswerStore(config.max_bytes, self.metrics.evictions.inc,
                                       owner_of=partial(tenant_of, namespace))  # fmt: skip
            self.metrics.bytes.set_function(lambda: float(memory.num_bytes))
            store = memory
        self.store = store
        self.namespace = namespace

    async def look_up(
        self,
        headers: Mapping[str, str],
        parsed: ChatRequest | CompletionRequest,
        sampling: SamplingOptions,
        tenant: Tenant,
        version: ModelVersion,
        user: str | None = None,
        *,
        serves_sampled: bool = False,
    ) -> CacheTicket:
        """The ticket of one request: ``sampling`` with the pool's defaults filled in,
        ``version`` the answering pool's (caches/key.py), ``user`` its prompt_cache_key,
        ``serves_sampled`` whether its model's response_cache degradation step is active
        (a sampled request is then answered with its greedy twin's answer, if stored)."""
        if not self.config.is_enabled:
            return OFF
        decision = decide(
            headers, sampling, tenant_allows=tenant.response_cache, serves_sampled=serves_sampled
        )
        if decision.bypass is not None:
            self.metrics.count_bypass(decision.bypass)
            return CacheTicket("bypass")
        if decision.is_twin:
            sampling = greedy_twin(sampling)
        fingerprint = request_fingerprint(parsed, sampling)
        key = cache_key(self.namespace, TenantScope(tenant.name, user), version, fingerprint)
        answer = await self.get(key) if decision.is_lookup else None
        result: Result = "hit" if answer is not None else "miss"
        self.metrics.lookups.labels(result).inc()
        if decision.is_twin:
            self.metrics.twin_lookups.labels(result).inc()
        stored_as = key if decision.is_store else None
        return CacheTicket(result, stored_as, answer, is_twin=decision.is_twin, cache=self)

    async def get(self, key: str) -> CachedAnswer | None:
        try:
            data = await self.store.get(key)
        except Exception as exc:  # a failing store is a miss, never a failed request
            self.metrics.errors.labels("get").inc()
            log.warning("response cache: lookup failed (%s); answering without it", exc)
            return None
        return None if data is None else decode(data)

    async def put(self, key: str, answer: CachedAnswer) -> None:
        data = encode(answer)
        if len(data) > self.config.max_entry_bytes:
            self.metrics.skipped_stores.labels("too_large").inc()
            return
        try:
            await self.store.put(key, data, self.config.ttl_s)
        except Exception as exc:
            self.metrics.skipped_stores.labels("error").inc()
            self.metrics.errors.labels("put").inc()
            log.warning("response cache: store failed (%s)", exc)
            return
        self.metrics.stores.inc()
        self.metrics.stored_bytes.inc(len(data))

    async def record(
        self, key: str, stream: AsyncGenerator[Item], num_choices: int
    ) -> AsyncGenerator[Item]:
        """Pass ``stream`` through; once it has ended without an error, store it if every
        choice finished normally. A client gone or an error ends this early: nothing stored."""
        items: list[Item] = []
        size = 0
        is_too_large = False
        try:
            async for item in stream:
                if not is_too_large:
                    items.append(item)
                    if isinstance(item, ChoiceDelta):
                        size += len(item.text.encode()) + _ROW_OVERHEAD_BYTES
                    is_too_large = size > self.config.max_entry_bytes
                    if is_too_large:
                        items = []  # nothing of it will be stored: free it now
                yield item
        except BaseException:
            self.metrics.skipped_stores.labels("unfinished").inc()
            raise
        finally:
            await stream.aclose()
        if is_too_large:
            self.metrics.skipped_stores.labels("too_large").inc()
            return
        answer = storable(items, num_choices)
        if answer is None:
            self.metrics.skipped_stores.labels("unfinished").inc()
            return
        await self.put(key, answer)

    async def purge(self, pool: str | None = None, tenant: str | None = None) -> int:
        """Delete the entries of a pool (and a tenant of it), or all; returns how many.
        A pool whose model changed needs none (its entries no longer match); this is for a
        change the router cannot see (new weights under the same name and identity)."""
        if tenant is not None and pool is None:
            raise ValueError("a tenant's entries are purged per pool")
        return await self.store.purge(key_prefix(self.namespace, pool, tenant))


def build_response_cache(
    config: ResponseCacheConfig, redis: Redis | None, registry: CollectorRegistry, namespace: str
) -> ResponseCache:
    """In the gateway's Redis when it has one (the tenants' connection: router replicas
    share the answers), else in process."""
    store = RedisAnswerStore(redis) if redis is not None and config.is_enabled else None
    return ResponseCache(config, store, registry, namespace)
