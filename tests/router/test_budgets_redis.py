"""Budgets in money in the Redis store, against a real redis-server: two stores (two router
replicas) share a tenant's daily and monthly spend, so what one charged the other judges,
and both answer as the in-process store does (test_money.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.tenants.buckets import seconds_until_next_utc_day, utc_day
from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.tenants.money import Budgets, seconds_until_next_utc_month, utc_month
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.store import UsageTotals

pytestmark = pytest.mark.integration

USD = 10**12


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def tenant(name: str, budgets: Budgets) -> Tenant:
    return Tenant(name, None, 0, Quotas(budgets=budgets), cache_salt=name)


async def _spend(store: RedisQuotaStore, t: Tenant, lease_id: str, pusd: int) -> str | None:
    admission = await store.admit(t, lease_id=lease_id, prompt_tokens=1)
    assert admission.is_admitted, admission
    await store.finish(t, lease_id=lease_id, prompt_tokens=1, completion_tokens=1,
                       usage=UsageTotals(spend_pusd=pusd))  # fmt: skip
    return admission.budget_warning


def test_daily_budget_is_shared_by_replicas(redis_server: RedisServer) -> None:
    t = tenant("daily", Budgets(daily_pusd=10 * USD, warning_fraction=0.8))

    async def run() -> None:
        a, b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
        try:
            one, two = RedisQuotaStore(a), RedisQuotaStore(b)
            assert await _spend(one, t, "1", 8 * USD + 1) is None
            # The other replica sees 8 USD and a pico-dollar of 10: past 80%.
            assert await _spend(two, t, "2", 2 * USD - 2) == "daily 80% of 10.00 USD"
            # One pico-dollar short of the budget: still admitted, at 99%.
            assert (await one.check(t, reserved_tokens=1)).budget_warning == (
                "daily 99% of 10.00 USD"
            )
            await _spend(one, t, "3", 1)
            refused = await two.admit(t, lease_id="4", prompt_tokens=1)
            assert (refused.is_admitted, refused.limit) == (False, "daily_budget_usd")
            assert abs(refused.retry_after_s - seconds_until_next_utc_day(time.time())) < 2
            # The spend counters hold exact integers, namespaced like the other quota keys.
            day_key = f"kvflow:default:{{daily}}:spend:day:{utc_day(time.time())}"
            month_key = f"kvflow:default:{{daily}}:spend:month:{utc_month(time.time())}"
            assert int(await a.get(day_key)) == int(await a.get(month_key)) == 10 * USD
            assert (await two.read_usage(t)).spend_pusd == 10 * USD
            # Another scope's tenant of the same name spends its own budget.
            other = RedisQuotaStore(a, scope="other-pool")
            assert (await other.check(t, reserved_tokens=1)).is_admitted
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(run())


def test_monthly_budget_refuses_until_the_utc_month_starts(redis_server: RedisServer) -> None:
    t = tenant("monthly", Budgets(daily_pusd=100 * USD, monthly_pusd=5 * USD))

    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            store = RedisQuotaStore(redis)
            await _spend(store, t, "1", 5 * USD)
            refused = await store.check(t, reserved_tokens=1)
            assert refused.limit == "monthly_budget_usd"
            assert abs(refused.retry_after_s - seconds_until_next_utc_month(time.time())) < 2
        finally:
            await redis.aclose()

    asyncio.run(run())
