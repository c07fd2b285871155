"""The levels' Redis store against a real redis-server: two stores on two connections are
two router replicas. A model and a global limit hold across both without double counting;
an in-flight lease that its replica stops renewing (it died) expires, one it renews does
not; and the Lua script answers as the in-process store does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis
from testkit.redis_server import RedisServer, running_redis

from kvflow.router.limits.levels import LevelLimits, LimitsConfig, Slot
from kvflow.router.limits.redis_store import RedisLimitStore
from kvflow.router.limits.service import LimitService
from kvflow.router.limits.store import MemoryLimitStore
from kvflow.router.protocol.errors import ApiError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@asynccontextmanager
async def two_replicas(
    url: str, scope: str, lease_ttl_s: float = 60.0
) -> AsyncIterator[tuple[RedisLimitStore, RedisLimitStore]]:
    a, b = Redis.from_url(url), Redis.from_url(url)
    try:
        yield (RedisLimitStore(a, lease_ttl_s=lease_ttl_s, scope=scope),
               RedisLimitStore(b, lease_ttl_s=lease_ttl_s, scope=scope))  # fmt: skip
    finally:
        await a.aclose()
        await b.aclose()


def test_model_and_global_limits_are_shared_without_double_counting(
    redis_server: RedisServer,
) -> None:
    model = Slot("model", "llama", LevelLimits(requests_per_minute=4))
    other_model = Slot("model", "mistral", LevelLimits(requests_per_minute=4))
    gateway = Slot("global", "", LevelLimits(requests_per_minute=6))

    async def run() -> None:
        async with two_replicas(redis_server.url, "shared") as (one, two):
            outcomes = []
            for i in range(6):  # alternating replicas, each request counted once
                store = (one, two)[i % 2]
                refusal = await store.admit([model, gateway], lease_id=f"l{i}",
                                            reserved_tokens=1, is_check=False)  # fmt: skip
                outcomes.append(None if refusal is None else refusal.limit_name)
            assert outcomes == [None] * 4 + ["model/llama/requests_per_minute"] * 2
            # The refused two took nothing from the global bucket: 2 of 6 are left for
            # another model, then the gateway as a whole is full.
            for store in (one, two):
                assert await store.admit([other_model, gateway], lease_id="x",
                                         reserved_tokens=1, is_check=False) is None  # fmt: skip
            refusal = await one.admit([other_model, gateway], lease_id="y", reserved_tokens=1,
                                      is_check=False)  # fmt: skip
            assert refusal is not None and refusal.limit_name == "global/requests_per_minute"
            assert 5 <= refusal.retry_after_s <= 10  # 60 s / 6 requests

    asyncio.run(run())


def test_in_flight_is_shared_and_released(redis_server: RedisServer) -> None:
    model = Slot("model", "llama", LevelLimits(max_in_flight=2, tokens_per_minute=1000))

    async def run() -> None:
        async with two_replicas(redis_server.url, "in-flight") as (one, two):
            assert await one.admit([model], lease_id="a", reserved_tokens=300,
                                   is_check=False) is None  # fmt: skip
            assert await two.admit([model], lease_id="b", reserved_tokens=300,
                                   is_check=False) is None  # fmt: skip
            refusal = await one.admit([model], lease_id="c", reserved_tokens=1, is_check=False)
            assert refusal is not None and refusal.limit_name == "model/llama/max_in_flight"
            assert refusal.retry_after_s == 1.0
            await two.finish([model], lease_id="b", unused_tokens=250, is_cancelled=False)
            # b's slot is free, and the 250 tokens it did not use are back: 650 left.
            assert await one.admit([model], lease_id="c", reserved_tokens=650,
                                   is_check=False) is None  # fmt: skip
            # 1000 - 300 - 300 + 250 - 650: the bucket is empty (tokens come before slots).
            refusal = await two.admit([model], lease_id="d", reserved_tokens=1, is_check=False)
            assert refusal is not None and refusal.kind == "tokens_per_minute"

    asyncio.run(run())


def test_a_dead_replicas_slot_expires_and_a_live_ones_is_renewed(
    redis_server: RedisServer,
) -> None:
    ttl_s = 1.5
    config = LimitsConfig(global_limits=LevelLimits(max_in_flight=1), lease_ttl_s=ttl_s)
    slots = config.slots(None, "m")

    async def run() -> None:
        redis_a, redis_b = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
        live = LimitService(config, RedisLimitStore(redis_a, lease_ttl_s=ttl_s, scope="ttl"))
        other = RedisLimitStore(redis_b, lease_ttl_s=ttl_s, scope="ttl")
        live.start()  # renews its leases every ttl / 3
        try:
            lease = await live.admit(slots, 1)
            await asyncio.sleep(ttl_s * 2.5)  # long past the TTL: still held, renewed
            refusal = await other.admit(slots, lease_id="b", reserved_tokens=1, is_check=False)
            assert refusal is not None and refusal.kind == "max_in_flight"
            # The holder dies mid-request: nothing renews or releases its lease any more.
            await live.stop()
            died_s = time.monotonic()
            while await other.admit(slots, lease_id="b", reserved_tokens=1, is_check=False):
                assert time.monotonic() - died_s < ttl_s + 2, "the dead replica's slot leaked"
                await asyncio.sleep(0.05)
            # Freed by its expiry, not before: the last renewal was at most ttl / 3 earlier.
            assert time.monotonic() - died_s >= ttl_s * 2 / 3 - 0.1
            await live.finish(lease, 1)  # a late release takes nothing from the new holder
            refusal = await other.admit(slots, lease_id="c", reserved_tokens=1, is_check=False)
            assert refusal is not None and refusal.kind == "max_in_flight"
        finally:
            await live.stop()
            await redis_a.aclose()
            await redis_b.aclose()

    asyncio.run(run())


def test_redis_answers_as_the_memory_store_does(redis_server: RedisServer) -> None:
    ip = Slot("client_ip", "2001:db8::/64", LevelLimits(requests_per_minute=3, max_in_flight=2))
    model = Slot("model", "llama", LevelLimits(tokens_per_minute=100))
    ip_name = "client_ip/2001:db8::/64"
    # (lease, reserved tokens, only check; then the lease to finish: unused, cancelled)
    script = [
        ("a", 40, False, None),
        ("b", 70, False, None),  # 60 tokens left
        ("b", 50, False, ("a", 30, True)),  # a never ran: its request and 30 tokens back
        ("c", 20, True, None),  # a check takes nothing
        ("c", 20, False, None),
        ("d", 5, False, ("b", 0, False)),  # two in flight from the address
        ("e", 1, False, None),
        ("f", 1, False, None),  # three requests this minute (a's was given back)
    ]
    expected = [None, "model/llama/tokens_per_minute", None, None, None,
                f"{ip_name}/max_in_flight", None, f"{ip_name}/requests_per_minute"]  # fmt: skip

    async def run() -> None:
        memory = MemoryLimitStore()
        async with two_replicas(redis_server.url, "parity") as (redis, _):
            for store in (memory, redis):
                answers = []
                for lease_id, reserved, is_check, then in script:
                    refusal = await store.admit(
                        [ip, model], lease_id=lease_id, reserved_tokens=reserved, is_check=is_check
                    )
                    answers.append(None if refusal is None else refusal.limit_name)
                    if then is not None:
                        done, unused, cancelled = then
                        await store.finish([ip, model], lease_id=done, unused_tokens=unused,
                                           is_cancelled=cancelled)  # fmt: skip
                assert answers == expected, store

    asyncio.run(run())


def test_a_debt_outlives_the_buckets_usual_expiry(redis_server: RedisServer) -> None:
    # One request reserving ten minutes of a model's tokens: the bucket is in debt for
    # about nine minutes, and Redis keeps it that long (the in-process store does too).
    model = Slot("model", "small", LevelLimits(tokens_per_minute=100))

    async def run() -> None:
        async with two_replicas(redis_server.url, "debt") as (one, two):
            assert await one.admit([model], lease_id="a", reserved_tokens=1000,
                                   is_check=False) is None  # fmt: skip
            refusal = await two.admit([model], lease_id="b", reserved_tokens=1, is_check=False)
            assert refusal is not None and 540 < refusal.retry_after_s < 541
            redis = Redis.from_url(redis_server.url)
            try:
                assert await redis.pttl(one.key(model, "tokens")) > 9 * 60_000
            finally:
                await redis.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["memory", "deny"])
def test_redis_stopped_falls_back_as_the_quotas_do(mode: str) -> None:
    config = LimitsConfig(global_limits=LevelLimits(requests_per_minute=1))
    slots = config.slots(None, "m")

    async def run() -> None:
        with running_redis() as server:
            redis = Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
            fallbacks: list[str] = []
            service = LimitService(config, RedisLimitStore(redis, lease_ttl_s=60, scope=mode),
                                   on_store_failure=mode, on_fallback=fallbacks.append)  # fmt: skip
            try:
                await service.finish(await service.admit(slots, 1), 1)  # Redis's one request
                server.stop()
                if mode == "deny":
                    with pytest.raises(ApiError) as info:
                        await service.admit(slots, 1)
                    assert info.value.status == 503 and info.value.retry_after_s == 2.0
                else:  # this replica's own minute, in memory: one request, then 429
                    lease = await service.admit(slots, 1)
                    assert not lease.in_redis
                    with pytest.raises(ApiError) as info:
                        await service.admit(slots, 1)
                    assert info.value.status == 429
                assert fallbacks and set(fallbacks) == {mode}
            finally:
                await redis.aclose()

    asyncio.run(run())
