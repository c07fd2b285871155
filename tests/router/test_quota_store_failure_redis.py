"""Quotas against a real redis-server that is killed and restarted: keys namespaced by the
router's quota scope, what happens while Redis is down (`memory` or `deny`, each counted),
and the daily budget outliving a router restart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.protocol.errors import ApiError
from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.service import RETRY_REDIS_AFTER_S, QuotaService
from kvflow.router.tenants.store import UsageTotals

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def tenant(name: str, **quotas: int) -> Tenant:
    return Tenant(name, None, 0, Quotas(**quotas), cache_salt=name)


def client(server: RedisServer) -> Redis:
    # The gateway's timeouts (api/gateway.py): a dead Redis fails fast.
    return Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)


def test_tenants_of_one_name_in_two_scopes_have_their_own_counters(
    redis_server: RedisServer,
) -> None:
    t = tenant("acme", max_concurrent_requests=1)

    async def run() -> None:
        redis = client(redis_server)
        try:
            pool_a = RedisQuotaStore(redis, scope="team-a/pool")
            pool_a_replica = RedisQuotaStore(redis, scope="team-a/pool")
            pool_b = RedisQuotaStore(redis, scope="team-b/pool")
            assert (await pool_a.admit(t, lease_id="1", prompt_tokens=1)).is_admitted
            # Another pool's "acme" is another tenant ...
            assert (await pool_b.admit(t, lease_id="2", prompt_tokens=1)).is_admitted
            # ... while a replica of the same pool shares the one slot.
            refused = await pool_a_replica.admit(t, lease_id="3", prompt_tokens=1)
            assert refused.limit == "max_concurrent_requests"
            keys = sorted(k.decode() for k in await redis.keys("kvflow:*"))
            assert keys == ["kvflow:team-a/pool:{acme}:leases", "kvflow:team-b/pool:{acme}:leases"]
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_deny_answers_503_with_retry_after_while_redis_is_down(
    redis_server: RedisServer,
) -> None:
    t = tenant("deny", requests_per_minute=1000)
    fallbacks: list[str] = []

    async def run() -> None:
        redis = client(redis_server)
        quotas = QuotaService(RedisQuotaStore(redis), on_store_failure="deny",
                              on_fallback=fallbacks.append)  # fmt: skip
        try:
            admission, lease = await quotas.admit(t, 1)
            assert admission.is_admitted and lease.in_redis
            await quotas.finish(lease, UsageTotals(prompt_tokens=1))
            redis_server.stop()  # killed
            for _ in range(2):  # the failure, then the wait before Redis is tried again
                with pytest.raises(ApiError) as refused:
                    await quotas.admit(t, 1)
                assert refused.value.status == 503
                assert refused.value.code == "quota_store_unavailable"
                assert refused.value.headers() == {"retry-after": "2"}
            assert fallbacks == ["deny", "deny"]
            redis_server.start()  # back, on the same port
            await asyncio.sleep(RETRY_REDIS_AFTER_S + 0.1)
            admission, lease = await quotas.admit(t, 1)
            assert admission.is_admitted and lease.in_redis
            assert fallbacks == ["deny", "deny"]
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_memory_admits_per_replica_while_redis_is_down_and_counts_it(
    redis_server: RedisServer,
) -> None:
    t = tenant("memory", max_concurrent_requests=1)
    fallbacks: list[str] = []

    async def run() -> None:
        redis = client(redis_server)
        quotas = QuotaService(RedisQuotaStore(redis), on_fallback=fallbacks.append)
        try:
            redis_server.stop()
            admission, lease = await quotas.admit(t, 1)
            assert admission.is_admitted and not lease.in_redis
            # The replica's own limits still hold.
            refused, _ = await quotas.admit(t, 1)
            assert refused.limit == "max_concurrent_requests"
            assert fallbacks == ["memory", "memory"]
            assert quotas.scope == "replica"
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_the_daily_budget_outlives_a_router_restart(redis_server: RedisServer) -> None:
    t = tenant("daily", daily_token_budget=100)

    async def run() -> None:
        first = client(redis_server)
        try:
            quotas = QuotaService(RedisQuotaStore(first))
            admission, lease = await quotas.admit(t, 60)
            assert admission.is_admitted
            await quotas.finish(lease, UsageTotals(prompt_tokens=60, completion_tokens=40))
        finally:
            await first.aclose()
        # A new router process: a new connection and nothing in memory.
        second = client(redis_server)
        try:
            restarted = QuotaService(RedisQuotaStore(second))
            refused, _ = await restarted.admit(t, 1)
            assert refused.limit == "daily_token_budget"
            assert refused.retry_after_s > 0
        finally:
            await second.aclose()

    asyncio.run(run())
