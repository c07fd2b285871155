"""Quotas and rate limits: the bucket arithmetic, the in-process store, the Redis store
against a real redis-server, and the service's fallback when Redis goes away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.tenants.buckets import Bucket, seconds_until_next_utc_day, take
from kvflow.router.tenants.config import (
    Quotas,
    Tenant,
    TenantConfigError,
    hash_api_key,
    parse_tenants,
)
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.service import QuotaService
from kvflow.router.tenants.store import MemoryQuotaStore, UsageTotals


def tenant(name: str = "t", **quotas: int) -> Tenant:
    return Tenant(name, None, 0, Quotas(**quotas), cache_salt=name)


class FakeClock:
    def __init__(self, now_s: float = 1_000_000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


# -- pure arithmetic -------------------------------------------------------------------------


def test_bucket_starts_full_refills_per_minute_and_allows_debt() -> None:
    ok, b, wait = take(None, 0.0, 60, cost=60, require=1)
    assert ok and b == Bucket(0.0, 0.0) and wait == 0
    ok, b2, wait = take(b, 0.5, 60, cost=1, require=1)
    assert not ok and wait == pytest.approx(0.5)  # 60/min refills 1 a second
    ok, b3, _ = take(b2, 1.0, 60, cost=100, require=1)
    assert ok and b3.level == pytest.approx(-99.0)  # debt: a big prompt goes through once
    ok, _, wait = take(b3, 2.0, 60, cost=1, require=1)
    assert not ok and wait == pytest.approx(99.0)
    assert take(None, 0.0, 10, cost=0, require=0)[1].level == 10  # never above capacity


def test_seconds_until_next_utc_day() -> None:
    assert seconds_until_next_utc_day(86_400 * 3 + 86_000) == 400


# -- the in-process store --------------------------------------------------------------------


def test_memory_requests_per_minute() -> None:
    clock = FakeClock()
    store, t = MemoryQuotaStore(clock), tenant(requests_per_minute=3)

    async def run() -> None:
        for i in range(3):
            assert (await store.admit(t, lease_id=f"l{i}", prompt_tokens=5)).is_admitted
        refused = await store.admit(t, lease_id="x", prompt_tokens=5)
        assert (refused.limit, refused.retry_after_s) == ("requests_per_minute", pytest.approx(20))
        clock.now_s += 20
        assert (await store.admit(t, lease_id="y", prompt_tokens=5)).is_admitted

    asyncio.run(run())


def test_memory_tokens_per_minute_charges_completion_at_the_end() -> None:
    clock = FakeClock()
    store, t = MemoryQuotaStore(clock), tenant(tokens_per_minute=600)

    async def run() -> None:
        assert (await store.admit(t, lease_id="a", prompt_tokens=100)).is_admitted
        await store.finish(t, lease_id="a", prompt_tokens=100, completion_tokens=600)
        refused = await store.admit(t, lease_id="b", prompt_tokens=1)
        # 600 - 100 - 600 = -100: 101 tokens missing at 10 a second.
        assert refused.limit == "tokens_per_minute"
        assert refused.retry_after_s == pytest.approx(10.1)

    asyncio.run(run())


def test_memory_concurrency_and_daily_budget() -> None:
    clock = FakeClock(86_400 * 10 + 80_000)
    store = MemoryQuotaStore(clock)
    t = tenant(max_concurrent_requests=2, daily_token_budget=50)

    async def run() -> None:
        assert (await store.admit(t, lease_id="a", prompt_tokens=10)).is_admitted
        assert (await store.admit(t, lease_id="b", prompt_tokens=10)).is_admitted
        assert (await store.admit(t, lease_id="c", prompt_tokens=10)).limit == (
            "max_concurrent_requests"
        )
        await store.finish(t, lease_id="a", prompt_tokens=10, completion_tokens=40)
        refused = await store.admit(t, lease_id="d", prompt_tokens=10)
        assert refused.limit == "daily_token_budget"
        assert refused.retry_after_s == pytest.approx(6_400)
        clock.now_s += 6_400  # a new UTC day
        assert (await store.admit(t, lease_id="e", prompt_tokens=10)).is_admitted

    asyncio.run(run())


def test_tenant_config_parsing() -> None:
    key_hash = hash_api_key("sk-test")
    directory = parse_tenants(
        [{"name": "acme", "api_key_sha256": key_hash, "models": ["m"], "requests_per_minute": 5}]
    )
    acme = directory.lookup("sk-test")
    assert acme is not None and acme.name == "acme"
    assert acme.may_use("m") and not acme.may_use("other")
    assert acme.quotas.requests_per_minute == 5 and acme.cache_salt
    assert directory.lookup("sk-wrong") is None and not directory.is_open
    assert parse_tenants(None).is_open
    bad = [
        ({"name": "a b", "api_key_sha256": key_hash}, "name"),
        ({"name": "a", "api_key_sha256": "sk-plain-key"}, "hash-api-key"),
        ({"name": "a", "api_key_sha256": key_hash, "requests_per_minute": 0}, "positive"),
        ({"name": "a", "api_key_sha256": key_hash, "rpm": 3}, "unknown fields"),
        ({"name": "a", "api_key_sha256": key_hash, "admin": "yes"}, "admin"),
    ]
    for raw, fragment in bad:
        with pytest.raises(TenantConfigError, match=fragment):
            parse_tenants([raw])
    with pytest.raises(TenantConfigError, match="used twice"):
        parse_tenants([{"name": "a", "api_key_sha256": key_hash}] * 2)


# -- Redis -----------------------------------------------------------------------------------


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.mark.integration
def test_redis_store_matches_the_memory_store(redis_server: RedisServer) -> None:
    """The same sequence of admissions gets the same answers from both stores."""
    t = tenant(requests_per_minute=5, tokens_per_minute=10_000, max_concurrent_requests=3)

    async def decisions(store: MemoryQuotaStore | RedisQuotaStore) -> list[str | None]:
        out: list[str | None] = []
        for i in range(8):
            admission = await store.admit(t, lease_id=f"l{i}", prompt_tokens=100)
            out.append(admission.limit)
            if i % 2 == 0 and admission.is_admitted:
                await store.finish(t, lease_id=f"l{i}", prompt_tokens=100, completion_tokens=50)
        return out

    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            got = await decisions(RedisQuotaStore(redis))
        finally:
            await redis.aclose()
        assert got == await decisions(MemoryQuotaStore())
        # Leases l1 and l3 stay held (odd ones are never finished): the 3rd concurrent,
        # l5, is admitted; rpm 5 runs out at l5; then rpm refuses.
        assert got == [None] * 5 + ["requests_per_minute"] * 3

    asyncio.run(run())


@pytest.mark.integration
def test_two_services_share_limits_through_redis(redis_server: RedisServer) -> None:
    t = tenant(requests_per_minute=6)

    async def run() -> None:
        clients = [Redis.from_url(redis_server.url) for _ in range(2)]
        services = [QuotaService(RedisQuotaStore(c)) for c in clients]
        try:
            admitted = 0
            for i in range(12):
                admission, lease = await services[i % 2].admit(t, 10)
                if admission.is_admitted:
                    admitted += 1
                    await services[i % 2].finish(lease, UsageTotals(prompt_tokens=10))
                else:
                    assert admission.limit == "requests_per_minute"
                    assert 0 < admission.retry_after_s <= 10
            assert admitted == 6  # not 6 per replica
            usage, scope = await services[1].read_usage(t)
            assert (usage.requests, usage.prompt_tokens, scope) == (6, 60, "cluster")
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(run())


@pytest.mark.integration
def test_concurrency_leases_are_shared_and_released(redis_server: RedisServer) -> None:
    t = tenant(max_concurrent_requests=2)

    async def run() -> None:
        clients = [Redis.from_url(redis_server.url) for _ in range(2)]
        a, b = (QuotaService(RedisQuotaStore(c)) for c in clients)
        try:
            ok1, lease1 = await a.admit(t, 1)
            ok2, _ = await b.admit(t, 1)
            refused, _ = await a.admit(t, 1)
            assert ok1.is_admitted and ok2.is_admitted
            assert refused.limit == "max_concurrent_requests"
            await a.finish(lease1, UsageTotals())
            assert (await b.admit(t, 1))[0].is_admitted
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(run())


@pytest.mark.integration
def test_redis_going_away_degrades_to_per_replica_limits(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    t = tenant(requests_per_minute=100)

    async def run() -> None:
        redis = Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        service = QuotaService(RedisQuotaStore(redis))
        try:
            admission, lease = await service.admit(t, 5)
            assert admission.is_admitted and lease.in_redis and service.scope == "cluster"
            redis_server.stop()
            # The lease taken in Redis is released without raising, and new requests are
            # admitted from the in-process store.
            await service.finish(lease, UsageTotals(prompt_tokens=5))
            for _ in range(3):
                admission, lease = await service.admit(t, 5)
                assert admission.is_admitted and not lease.in_redis
                await service.finish(lease, UsageTotals(prompt_tokens=5))
            assert service.scope == "replica"
            usage, scope = await service.read_usage(t)
            assert scope == "replica" and usage.requests == 4  # the Redis lease counts too
            redis_server.start()
            await asyncio.sleep(2.5)  # past RETRY_REDIS_AFTER_S
            admission, lease = await service.admit(t, 5)
            assert admission.is_admitted and lease.in_redis
        finally:
            await redis.aclose()

    with caplog.at_level(logging.WARNING, logger="kvflow.router.quotas"):
        asyncio.run(run())
    messages = [r.getMessage() for r in caplog.records]
    assert any("Redis is unreachable" in m for m in messages)
    assert any("reachable again" in m for m in messages)
