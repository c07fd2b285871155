"""The Redis quota script's token limits, tripped against a real redis-server.

`tokens_per_minute` and `daily_token_budget` are the branches of redis_store.py's Lua
script that the shared-limit tests never reach (they spend requests and leases). Two
stores (two router replicas) share one server: what one spends, the other is refused.
Redis's own clock runs during the test, so waits are checked to within the test's
duration; the arithmetic is the same as the in-process store's (test_quotas.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.tenants.buckets import seconds_until_next_utc_day
from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.store import MemoryQuotaStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def tenant(name: str, **quotas: int) -> Tenant:
    return Tenant(name, None, 0, Quotas(**quotas), cache_salt=name)


def test_tokens_per_minute_is_spent_by_prompts_and_completions_across_replicas(
    redis_server: RedisServer,
) -> None:
    t = tenant("tpm", tokens_per_minute=600)

    async def run() -> None:
        a, b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
        try:
            one, two = RedisQuotaStore(a), RedisQuotaStore(b)
            started = time.monotonic()
            # A prompt larger than the bucket still goes through once (debt) ...
            assert (await one.admit(t, lease_id="a", prompt_tokens=100)).is_admitted
            await one.finish(t, lease_id="a", prompt_tokens=100, completion_tokens=600)
            # ... and the other replica sees the debt: 600 - 100 - 600 = -100, so 101
            # tokens are missing at 10 a second.
            refused = await two.admit(t, lease_id="b", prompt_tokens=1)
            elapsed_s = time.monotonic() - started
            assert refused.limit == "tokens_per_minute"
            assert 10.1 - elapsed_s - 0.01 <= refused.retry_after_s <= 10.1 + 0.001
            # Another tenant's bucket is its own.
            other = tenant("tpm-other", tokens_per_minute=600)
            assert (await two.admit(other, lease_id="c", prompt_tokens=1)).is_admitted
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(run())


def test_tokens_per_minute_refills_at_capacity_per_minute(redis_server: RedisServer) -> None:
    t = tenant("tpm-refill", tokens_per_minute=6000)  # 100 tokens a second

    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            store = RedisQuotaStore(redis)
            assert (await store.admit(t, lease_id="a", prompt_tokens=6000)).is_admitted
            refused = await store.admit(t, lease_id="b", prompt_tokens=1)
            assert refused.limit == "tokens_per_minute"
            assert 0.0 < refused.retry_after_s <= 0.011  # 1 token at 100 a second
            await asyncio.sleep(0.05)  # 5 tokens refilled
            assert (await store.admit(t, lease_id="c", prompt_tokens=1)).is_admitted
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_daily_token_budget_refuses_until_the_next_utc_day(redis_server: RedisServer) -> None:
    t = tenant("daily", daily_token_budget=50)

    async def run() -> None:
        a, b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
        try:
            one, two = RedisQuotaStore(a), RedisQuotaStore(b)
            assert (await one.admit(t, lease_id="a", prompt_tokens=10)).is_admitted
            # Spending is counted when a request finishes: still under budget here.
            assert (await two.admit(t, lease_id="b", prompt_tokens=10)).is_admitted
            await one.finish(t, lease_id="a", prompt_tokens=10, completion_tokens=30)
            assert (await two.admit(t, lease_id="c", prompt_tokens=10)).is_admitted
            await two.finish(t, lease_id="b", prompt_tokens=10, completion_tokens=0)
            # 40 + 10 = 50 spent: the budget is reached, on both replicas.
            for store in (one, two):
                before_s = seconds_until_next_utc_day(time.time())
                refused = await store.admit(t, lease_id="d", prompt_tokens=1)
                after_s = seconds_until_next_utc_day(time.time())
                assert refused.limit == "daily_token_budget"
                assert after_s - 0.01 <= refused.retry_after_s <= before_s + 0.01
            # The counter is the UTC day's: it expires after the next day, not never.
            ttl_s = await a.ttl(f"kvflow:default:{{daily}}:day:{int(time.time() // 86_400)}")
            assert 86_400 < ttl_s <= 2 * 86_400
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(run())


def test_check_answers_as_admit_would_and_takes_nothing(redis_server: RedisServer) -> None:
    """The check the gateway makes before preparing a request's prompts: both stores refuse
    a tenant over its requests per minute, its tokens per minute or its daily budget as
    `admit` would, and a check that passes leaves every counter as it was."""

    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            for store in (MemoryQuotaStore(), RedisQuotaStore(redis, scope="check")):
                rpm = tenant("check-rpm", requests_per_minute=2)
                for _ in range(5):  # checks take no request from the bucket
                    assert (await store.check(rpm, reserved_tokens=1)).is_admitted
                assert (await store.admit(rpm, lease_id="a", prompt_tokens=1)).is_admitted
                assert (await store.admit(rpm, lease_id="b", prompt_tokens=1)).is_admitted
                refused = await store.check(rpm, reserved_tokens=1)
                assert refused.limit == "requests_per_minute" and refused.retry_after_s > 0
                tpm = tenant("check-tpm", tokens_per_minute=600)
                assert (await store.check(tpm, reserved_tokens=600)).is_admitted
                assert (await store.check(tpm, reserved_tokens=600)).is_admitted  # untaken
                assert (await store.admit(tpm, lease_id="c", prompt_tokens=500)).is_admitted
                refused = await store.check(tpm, reserved_tokens=200)
                assert refused.limit == "tokens_per_minute"
                assert 9.9 <= refused.retry_after_s <= 10.0  # 100 missing at 10 a second
                daily = tenant("check-daily", daily_token_budget=10)
                assert (await store.admit(daily, lease_id="d", prompt_tokens=5)).is_admitted
                await store.finish(daily, lease_id="d", prompt_tokens=5, completion_tokens=5)
                refused = await store.check(daily, reserved_tokens=1)
                assert refused.limit == "daily_token_budget"
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_a_refreshed_lease_keeps_its_set_alive_past_the_last_admission(
    redis_server: RedisServer,
) -> None:
    """The lease set expires a TTL after the last admission; a stream that runs longer
    with no admission after it keeps its lease (and the tenant its concurrency count)
    because each refresh extends the set too."""
    t = tenant("long-stream", max_concurrent_requests=1)

    async def run() -> None:
        r = Redis.from_url(redis_server.url)
        try:
            store = RedisQuotaStore(r)
            assert (await store.admit(t, lease_id="long", prompt_tokens=1)).is_admitted
            key = store._key(t, "leases")
            # The set's expiry, not the lease's, is what lapses: bring it near.
            await r.pexpire(key, 300)
            await store.refresh_leases(t, ["long"])
            await asyncio.sleep(0.5)
            assert await r.zscore(key, "long") is not None
            refused = await store.admit(t, lease_id="second", prompt_tokens=1)
            assert refused.limit == "max_concurrent_requests"
            # A refresh of leases that are gone does not revive the set.
            await store.finish(t, lease_id="long", prompt_tokens=1, completion_tokens=0)
            await store.refresh_leases(t, ["long"])
            assert await r.zcard(key) == 0
        finally:
            await r.aclose()

    asyncio.run(run())
