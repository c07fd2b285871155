"""The Redis store holds a request's token reservation exactly as the in-process store does
(a real redis-server): the whole worst case is required and taken at admission, the unused
part given back at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, ConnectionPool
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.store import MemoryQuotaStore, UsageTotals

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


def test_redis_reservations_match_the_memory_store(redis_server: RedisServer) -> None:
    t = Tenant("reserve", None, 0, Quotas(tokens_per_minute=600), cache_salt="reserve")

    async def decisions(store: MemoryQuotaStore | RedisQuotaStore) -> list[str | None]:
        out = []
        out.append((await store.admit(t, lease_id="a", prompt_tokens=100,
                                      reserved_tokens=500)).limit)  # fmt: skip
        out.append((await store.admit(t, lease_id="b", prompt_tokens=10,
                                      reserved_tokens=200)).limit)  # fmt: skip
        await store.finish(t, lease_id="a", prompt_tokens=100, completion_tokens=50,
                           reserved_tokens=500)  # fmt: skip
        # 100 left + 350 given back: 450 fit, 451 would not.
        out.append((await store.admit(t, lease_id="c", prompt_tokens=10,
                                      reserved_tokens=449)).limit)  # fmt: skip
        out.append((await store.admit(t, lease_id="d", prompt_tokens=1,
                                      reserved_tokens=5)).limit)  # fmt: skip
        return out

    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        try:
            got = await decisions(RedisQuotaStore(redis))
        finally:
            await redis.aclose()
        assert got == await decisions(MemoryQuotaStore())
        assert got == [None, "tokens_per_minute", None, "tokens_per_minute"]

    asyncio.run(run())


def test_finishing_records_usage_with_the_lease_in_one_round_trip(
    redis_server: RedisServer,
) -> None:
    """The settlement a multi-tenant gateway pays after every request: releasing the lease,
    settling tokens and adding the usage totals are one script, not a script and a pipeline
    (each round trip was about 0.6 ms at P50 in the gateway benchmark)."""
    quotas = Quotas(tokens_per_minute=600, max_concurrent_requests=1)
    t = Tenant("settle", None, 0, quotas, cache_salt="settle")
    usage = UsageTotals(requests=1, prompt_tokens=100, completion_tokens=50, cached_tokens=64)

    async def settle(store: MemoryQuotaStore | RedisQuotaStore) -> tuple[UsageTotals, str | None]:
        await store.admit(t, lease_id="a", prompt_tokens=100, reserved_tokens=500)
        await store.finish(t, lease_id="a", prompt_tokens=100, completion_tokens=50,
                           reserved_tokens=500, usage=usage)  # fmt: skip
        # The lease is gone (concurrency 1 admits again) and the totals are in.
        again = await store.admit(t, lease_id="b", prompt_tokens=1)
        return await store.read_usage(t), again.limit

    async def run() -> None:
        sends: list[int] = []

        class CountingConnection(Connection):
            async def send_packed_command(self, *args: Any, **kwargs: Any) -> None:
                sends.append(1)  # one write to the socket: a command or a whole pipeline
                await super().send_packed_command(*args, **kwargs)

        pool = ConnectionPool.from_url(redis_server.url, connection_class=CountingConnection)
        redis = Redis(connection_pool=pool)
        try:
            store = RedisQuotaStore(redis)
            await store.admit(t, lease_id="warm", prompt_tokens=1)
            await store.finish(t, lease_id="warm", prompt_tokens=1, completion_tokens=0,
                               usage=UsageTotals(requests=1))  # loads the script  # fmt: skip
            await store.admit(t, lease_id="warm2", prompt_tokens=1)
            sends.clear()
            await store.finish(t, lease_id="warm2", prompt_tokens=1, completion_tokens=0,
                               usage=UsageTotals(requests=1))  # fmt: skip
            assert len(sends) == 1
            await redis.flushall()
            got = await settle(RedisQuotaStore(redis))
        finally:
            await redis.aclose()
        assert got == await settle(MemoryQuotaStore())
        assert got == (usage, None)

    asyncio.run(run())
