"""The Redis store holds a request's token reservation exactly as the in-process store does
(a real redis-server): the whole worst case is required and taken at admission, the unused
part given back at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.tenants.redis_store import RedisQuotaStore
from kvflow.router.tenants.store import MemoryQuotaStore

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
