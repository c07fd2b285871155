"""The Batch API's Redis store against a real redis-server, two connections as two router
replicas: a batch's lease is held by one replica at a time, renewed only by its holder and
taken over once it lapses; a line's result is stored once, by the first writer, in one of
the two hashes, however the replicas race."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.batch.store import RedisBatchStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@asynccontextmanager
async def two_replicas(url: str, scope: str) -> AsyncIterator[tuple[RedisBatchStore, ...]]:
    a, b = Redis.from_url(url), Redis.from_url(url)
    try:
        yield RedisBatchStore(a, scope), RedisBatchStore(b, scope)
    finally:
        await a.aclose()
        await b.aclose()


def test_one_replica_holds_a_lease_and_another_takes_it_once_it_lapses(
    redis_server: RedisServer,
) -> None:
    async def run() -> None:
        async with two_replicas(redis_server.url, "lease") as (a, b):
            assert await a.claim("batch-1", "a", 0.3)
            assert not await b.claim("batch-1", "b", 0.3)
            for _ in range(3):  # renewed by its holder past its first TTL
                await asyncio.sleep(0.15)
                assert await a.claim("batch-1", "a", 0.3)
                assert not await b.claim("batch-1", "b", 0.3)
            await asyncio.sleep(0.4)  # a stops renewing (it died)
            assert await b.claim("batch-1", "b", 0.3)
            assert not await a.claim("batch-1", "a", 0.3)  # a holder's renewal, not a's

    asyncio.run(run())


def test_a_lines_result_is_stored_once_by_the_first_writer(redis_server: RedisServer) -> None:
    async def run() -> None:
        async with two_replicas(redis_server.url, "results") as (a, b):
            await a.add_result("batch-1", 0, True, "first")
            await b.add_result("batch-1", 0, False, "second")  # another replica ran it too
            await b.add_result("batch-1", 0, True, "third")
            assert await a.results("batch-1") == {0: (True, "first")}
            # Racing replicas: each line lands in exactly one hash.
            writes = [store.add_result("batch-2", i, ok, f"{i}-{ok}")
                      for i in range(50) for store, ok in ((a, True), (b, False))]  # fmt: skip
            started = time.monotonic()
            await asyncio.gather(*writes)
            assert time.monotonic() - started < 10
            ok, failed = await a.counts("batch-2")
            assert ok + failed == 50
            assert len(await b.results("batch-2")) == 50

    asyncio.run(run())
