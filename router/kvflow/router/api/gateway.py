"""Everything one gateway process holds, assembled from its settings (state on app.state):
one backend per pool (api/backend.py), and what the pools share: tenants, quotas, Redis,
metrics, and the routes from public model names to pools (models/routes.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from kvflow.router.api.backend import (
    DEFAULT_POOL,
    PoolBackend,
    PoolSource,
    build_backend,
)
from kvflow.router.api.semantic_cache import text_embedder
from kvflow.router.caches.config import ResponseCacheConfig
from kvflow.router.caches.semantic_config import SemanticCacheConfig
from kvflow.router.caches.semantic_service import SemanticCache, build_semantic_cache
from kvflow.router.caches.service import ResponseCache, build_response_cache
from kvflow.router.cascade.service import Cascade
from kvflow.router.degrade.service import Degradation
from kvflow.router.limits.levels import LimitsConfig
from kvflow.router.limits.redis_store import RedisLimitStore
from kvflow.router.limits.service import LimitService
from kvflow.router.metrics import RouterMetrics
from kvflow.router.models.routes import ModelRoutes, describe, session_draw
from kvflow.router.protocol.errors import (
    ApiError,
    circuit_open,
    invalid_api_key,
    model_not_allowed,
    model_not_found,
    no_worker_available,
)
from kvflow.router.settings import RouterSettings
from kvflow.router.tenants.config import ANONYMOUS, Tenant, parse_tenants
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.salts import CACHE_SALT_SECRET_ENV
from kvflow.router.tenants.service import QuotaService
from kvflow.router.tenants.source import TenantSource, key_secret_from_env
from kvflow.router.text.model_files import TextModel

log = logging.getLogger("kvflow.router")

# Redis calls sit on the request path: a stalled Redis must cost a request at most this
# much before the in-process fallback takes over.
REDIS_TIMEOUT_S = 0.5


def _mask(api_key: str) -> str:
    return api_key[:3] + "***" + api_key[-2:] if len(api_key) > 8 else "***"


@dataclass(frozen=True)
class Route:
    """Where a request goes: the backend, and the name its workers serve the model as
    (what the workers are asked for, and the response's `model`)."""

    backend: PoolBackend
    served_name: str


@dataclass
class Gateway:
    settings: RouterSettings
    backends: tuple[PoolBackend, ...]
    quotas: QuotaService
    metrics: RouterMetrics
    redis: Redis | None
    routes: ModelRoutes = field(default_factory=ModelRoutes)
    # The tenants in force (the config's, or a file's, re-read when it changes).
    tenants: TenantSource = field(
        default_factory=lambda: TenantSource(parse_tenants(None), None, None)
    )
    # Draws a weighted target for a request without a session (seeded by --seed).
    rng: random.Random = field(default_factory=random.Random)
    # Each configured model's degradation ladder (degrade/service.py); none: off.
    degradation: Degradation = field(default_factory=lambda: Degradation({}))
    # Answers of repeated deterministic requests (caches/; off unless --response-cache on).
    response_cache: ResponseCache = field(
        default_factory=lambda: ResponseCache(ResponseCacheConfig())
    )
    # Near-match answers for opted-in models and tenants (caches/semantic_service.py).
    semantic_cache: SemanticCache = field(
        default_factory=lambda: SemanticCache(SemanticCacheConfig())
    )
    # Limits per model, client IP and for the whole gateway (limits/).
    limits: LimitService = field(default_factory=lambda: LimitService(LimitsConfig(), None))
    # Each configured model's cascade, small model first (cascade/); none: off.
    cascade: Cascade = field(default_factory=lambda: Cascade({}))

    @property
    def session_header(self) -> str:
        return self.settings.config.session_header

    @property
    def has_pools(self) -> bool:
        """Several pools from `pools:`; False: one from the command line, as before."""
        return bool(self.settings.config.pools)

    async def start(self) -> None:
        self.quotas.start()
        self.limits.start()
        for backend in self.backends:
            await backend.start()
        self.degradation.start()

    async def stop(self) -> None:
        await self.degradation.stop()
        await asyncio.gather(*(b.stop() for b in self.backends))
        await self.quotas.stop()
        await self.limits.stop()
        if self.redis is not None:
            await self.redis.aclose()

    def _served_by_pool(self) -> dict[str, str]:
        served = {b.name: b.served_name() for b in self.backends}
        return {pool: name for pool, name in served.items() if name is not None}

    def served_models(self) -> list[str]:
        """Every model name a client may send (before tenant allowlists)."""
        if not self.has_pools:
            return self.backends[0].served_models()
        return self.routes.public_names(self._served_by_pool())

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        tenants = self.tenants.current
        if tenants.is_open:
            return ANONYMOUS
        authorization = headers.get("authorization", "")
        scheme, _, api_key = authorization.partition(" ")
        api_key = api_key.strip()
        if scheme.lower() != "bearer" or not api_key:
            raise invalid_api_key(
                "You didn't provide an API key. Provide it in an Authorization header using "
                "Bearer auth (Authorization: Bearer YOUR_KEY)."
            )
        tenant = tenants.lookup(api_key)
        if tenant is None:
            raise invalid_api_key(f"Incorrect API key provided: {_mask(api_key)}.")
        return tenant

    def caller_or_none(self, headers: Mapping[str, str]) -> Tenant | None:
        """The caller's tenant, or None for a caller without a valid key (no 401): for
        the endpoints anyone may reach, which then tell such a caller less."""
        try:
            return self.authenticate(headers)
        except ApiError:
            return None

    def check_model(self, model: str, tenant: Tenant) -> None:
        """404 for a model nobody serves, 403 for one this tenant may not use."""
        served = self.served_models()
        if not served:  # no served name configured, and no worker has answered yet
            num_workers = sum(len(b.pool) for b in self.backends)
            raise no_worker_available(
                f"No worker has reported its model yet ({num_workers} known); retry shortly."
            )
        if model not in served:
            raise model_not_found(model, [m for m in served if tenant.may_use(m)])
        if not tenant.may_use(model):
            raise model_not_allowed(model)

    def is_refusing(self, model: str) -> bool:
        """Whether every pool that answers the public name ``model`` refuses requests now:
        its circuit breaker open, or no healthy worker. Degradation then sends the request
        to the model's fallback at once (degrade/service.py) instead of a 503."""
        if not self.has_pools:
            return False  # a fallback needs pools (degrade/config.py)
        served_by_pool = self._served_by_pool()
        pools = self.routes.pools_of(model) or [
            pool for pool, served in served_by_pool.items() if served == model
        ]
        by_name = {b.name: b for b in self.backends}
        backends = [by_name[p] for p in pools if p in by_name]
        return bool(backends) and not any(
            b.pool.num_healthy() > 0 and b.pool.circuit_refusal() is None for b in backends
        )

    def route(self, model: str, tenant: Tenant, session_id: str | None) -> Route:
        """The pool that answers ``model`` for this request: 404/403 as check_model, 503
        when the pool's model name is not known yet, or at once, before any work, while
        its circuit breaker is open (a pool whose circuit is open is not drawn while
        another target of the model can answer). A session always draws the same target;
        a request without one draws from the seeded RNG."""
        self.check_model(model, tenant)
        if not self.has_pools:
            return Route(_circuit_closed(self.backends[0]), model)
        draw = session_draw(session_id) if session_id is not None else self.rng.random()
        served_by_pool = self._served_by_pool()
        by_name = {b.name: b for b in self.backends}

        def is_serving(pool: str) -> bool:
            workers = by_name[pool].pool
            return (pool in served_by_pool and workers.num_healthy() > 0
                    and workers.circuit_refusal() is None)  # fmt: skip

        pool = self.routes.resolve(model, draw, served_by_pool, is_serving)
        assert pool is not None, model  # check_model found it among the public names
        backend = by_name[pool]
        served_name = served_by_pool.get(pool)
        if served_name is None:
            raise no_worker_available(
                f"No worker of pool '{pool}' has reported its model yet "
                f"({backend.pool.num_healthy()} of {len(backend.pool)} workers healthy); "
                "retry shortly."
            )
        return Route(_circuit_closed(backend), served_name)

    def readiness(
        self, is_draining: bool, caller: Tenant | None = ANONYMOUS
    ) -> tuple[bool, dict[str, Any]]:
        """Ready when some pool has a healthy worker; the body counts them. Per pool, with
        their model names, only for a caller who may list models: with tenants configured
        an anonymous probe learns counts, not what is served. A tenants file that failed to
        load shows as ``tenants_stale`` (the older tenants stay in force): not a reason to
        be unready, which would take every replica out at once over a typo."""
        num_healthy = sum(b.pool.num_healthy() for b in self.backends)
        is_ready = num_healthy > 0 and not is_draining
        body: dict[str, Any] = {"ready": is_ready, "workers_healthy": num_healthy,
                                "workers": sum(len(b.pool) for b in self.backends),
                                "draining": is_draining}  # fmt: skip
        _ = self.tenants.current  # the file's reload check rides on probes too
        if self.tenants.path is not None:
            body["tenants_stale"] = self.tenants.is_stale
        if self.has_pools and caller is not None:
            body["pools"] = {
                b.name: {"workers_healthy": b.pool.num_healthy(), "workers": len(b.pool),
                         "served_model_name": b.served_name()}
                for b in self.backends
            }  # fmt: skip
        return is_ready, body


def _circuit_closed(backend: PoolBackend) -> PoolBackend:
    """``backend``, unless its circuit breaker refuses requests now: then a 503 with
    Retry-After at once, instead of preparing and queueing the request for workers that
    cannot take it (docs/router.md, "Circuit breaker")."""
    refusal = backend.pool.circuit_refusal()
    if refusal is not None:
        raise circuit_open(backend.name, refusal.why, refusal.retry_after_s)
    return backend


def _pool_sources(settings: RouterSettings) -> list[PoolSource]:
    config = settings.config
    if not config.pools:
        only = PoolSource(DEFAULT_POOL, settings.model, settings.served_model_name,
                          settings.workers, settings.worker_dns, config.disaggregation,
                          settings.worker_tls)  # fmt: skip
        return [only]
    return [PoolSource(p.name, p.model, p.served_model_name, p.workers, p.worker_dns,
                       p.disaggregation, p.tls(settings.worker_tls))
            for p in config.pools]  # fmt: skip


def build_gateway(settings: RouterSettings) -> Gateway:
    """Load each pool's tokenizer and wire the components; nothing runs until `start()`."""
    config = settings.config
    metrics = RouterMetrics()
    sources = _pool_sources(settings)
    texts: dict[str | None, TextModel] = {}  # pools naming the same files load them once
    backends = tuple(
        build_backend(s, settings, metrics, label=f"pool {s.name}: " if config.pools else "",
                      texts=texts)
        for s in sources
    )  # fmt: skip
    if config.pools:
        log.info("pools: %s; models: %s", [b.name for b in backends],
                 describe(config.models) or "each pool's served name")  # fmt: skip
    redis = None
    if settings.redis_url:
        redis = Redis.from_url(
            settings.redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
        )
    quotas = QuotaService(
        RedisQuotaStore(redis, scope=settings.quota_scope) if redis is not None else None,
        on_store_failure=settings.quota_on_store_failure,
        on_fallback=lambda action: metrics.quota_store_fallbacks.labels(action).inc(),
    )
    metrics.watch({b.name: b.pool for b in backends}, lambda: sum(len(b.index) for b in backends))
    metrics.circuits.watch({b.name: b.pool for b in backends})
    tenants = TenantSource(config.tenants, settings.tenants_file, key_secret_from_env(),
                           salt_secret=settings.cache_salt_secret,
                           on_reload_failure=metrics.tenants_reload_failures.inc)  # fmt: skip
    metrics.tenants_stale.set_function(lambda: float(tenants.is_stale))
    served = settings.served_model_name
    for model in config.degradation if not config.pools and served is not None else ():
        if model != served:  # with pools the config's check is exact (degrade/config.py)
            log.warning("degradation.%s names no model this gateway serves (it serves %r): "
                        "that ladder never applies", model, served)  # fmt: skip
    if tenants.current.is_open:
        log.warning("no tenants configured: the gateway accepts any API key (one shared cache)")
    elif settings.cache_salt_secret is None:
        log.warning(
            "no cache salt secret (--cache-salt-secret-file or %s): tenants' cache salts are "
            "random to this process, so router replicas share no prefix cache",
            CACHE_SALT_SECRET_ENV,
        )
    gw = Gateway(
        settings=settings,
        backends=backends,
        quotas=quotas,
        metrics=metrics,
        redis=redis,
        routes=config.models,
        tenants=tenants,
        rng=random.Random(settings.seed),
        degradation=Degradation(config.degradation, metrics.registry),
        response_cache=build_response_cache(
            settings.response_cache, redis, metrics.registry, settings.quota_scope
        ),
        limits=_limit_service(settings, redis, metrics),
        cascade=Cascade(config.cascade, metrics.registry),
    )
    semantic = config.semantic_cache
    embed = None
    if semantic.embedding_model is not None:
        embed = text_embedder(gw, semantic.embedding_model, semantic.embed_timeout_s)
    gw.semantic_cache = build_semantic_cache(
        semantic, embed, redis, metrics.registry, settings.quota_scope
    )
    return gw


def _limit_service(
    settings: RouterSettings, redis: Redis | None, metrics: RouterMetrics
) -> LimitService:
    """The levels' limits, in the quotas' Redis (and under their scope and failure mode)."""
    config = settings.config.rate_limits
    store = None
    if redis is not None and config.is_limited:
        store = RedisLimitStore(redis, lease_ttl_s=config.lease_ttl_s, scope=settings.quota_scope)
    return LimitService(
        config,
        store,
        on_store_failure=settings.quota_on_store_failure,
        on_fallback=lambda action: metrics.quota_store_fallbacks.labels(action).inc(),
        on_refusal=lambda level, kind: metrics.limit_rejections.labels(level, kind).inc(),
    )
