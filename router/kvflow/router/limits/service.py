"""The levels' limits for the request path: Redis when configured and reachable, this
process otherwise; the in-flight leases this replica holds, renewed while their requests
run; and the 429 that names the limit.

Redis failing is handled as the tenants' quotas handle it (tenants/service.py), under the
same --quota-on-store-failure: "memory" serves with per-replica limits meanwhile, "deny"
answers 503. A request admitted in Redis is released in Redis; if that fails its lease
expires on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.router.limits.decide import Refusal
from kvflow.router.limits.errors import limit_exceeded
from kvflow.router.limits.levels import LimitsConfig, Slot
from kvflow.router.limits.redis_store import RedisLimitStore
from kvflow.router.limits.store import MemoryLimitStore
from kvflow.router.store_errors import STORE_ERRORS
from kvflow.router.tenants.service import RETRY_REDIS_AFTER_S, quota_store_unavailable

log = logging.getLogger("kvflow.router.limits")


@dataclass
class LevelLease:
    """One admitted request's hold on its levels, released by `LimitService.finish`."""

    lease_id: str
    slots: tuple[Slot, ...]
    reserved_tokens: int
    in_redis: bool


class LimitService:
    def __init__(
        self,
        config: LimitsConfig,
        redis_store: RedisLimitStore | None,
        *,
        on_store_failure: str = "memory",
        on_fallback: Callable[[str], None] = lambda action: None,
        on_refusal: Callable[[str, str], None] = lambda level, kind: None,
    ) -> None:
        """``on_fallback(action)``: for each decision taken without Redis;
        ``on_refusal(level, kind)``: for each 429."""
        self.config = config
        self._redis = redis_store
        self._is_deny = on_store_failure == "deny"
        self._on_fallback = on_fallback
        self._on_refusal = on_refusal
        self._memory = MemoryLimitStore()
        self._redis_down_until_s = 0.0
        self._active: dict[str, LevelLease] = {}
        self._renew_task: asyncio.Task[None] | None = None
        self._releasing: set[asyncio.Task[None]] = set()

    def slots(self, client_ip: str | None, model: str) -> tuple[Slot, ...]:
        return self.config.slots(client_ip, model)

    def _use_redis(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_down_until_s

    def _redis_failed(self, exc: BaseException) -> None:
        if self._redis_down_until_s == 0.0:
            log.warning("Redis is unreachable (%s): model, client and global limits now hold "
                        "per router replica until it is back", exc)  # fmt: skip
        self._redis_down_until_s = time.monotonic() + RETRY_REDIS_AFTER_S

    def _redis_ok(self) -> None:
        if self._redis_down_until_s != 0.0:
            log.warning("Redis is reachable again: model, client and global limits are "
                        "shared across replicas again")  # fmt: skip
            self._redis_down_until_s = 0.0

    async def _decide(
        self, slots: Sequence[Slot], lease_id: str, reserved_tokens: int, *, is_check: bool
    ) -> tuple[Refusal | None, bool]:
        """(the refusal or None, whether Redis decided)."""
        if self._redis is not None and self._use_redis():
            try:
                refusal = await self._redis.admit(slots, lease_id=lease_id,
                                                  reserved_tokens=reserved_tokens,
                                                  is_check=is_check)  # fmt: skip
                self._redis_ok()
                return refusal, True
            except STORE_ERRORS as exc:
                self._redis_failed(exc)
        if self._redis is not None:
            self._on_fallback("deny" if self._is_deny else "memory")
            if self._is_deny:
                raise quota_store_unavailable()
        refusal = await self._memory.admit(slots, lease_id=lease_id,
                                           reserved_tokens=reserved_tokens,
                                           is_check=is_check)  # fmt: skip
        return refusal, False

    def _refuse(self, refusal: Refusal) -> Exception:
        self._on_refusal(refusal.slot.level, refusal.kind)
        return limit_exceeded(refusal)

    async def check(self, slots: Sequence[Slot], reserved_tokens: int) -> None:
        """429 if `admit` would refuse a request reserving ``reserved_tokens``; takes
        nothing (before a request's prompts are prepared)."""
        if slots:
            refusal, _ = await self._decide(slots, "", reserved_tokens, is_check=True)
            if refusal is not None:
                raise self._refuse(refusal)

    async def admit(self, slots: Sequence[Slot], reserved_tokens: int) -> LevelLease:
        """Take a request, its reservation and an in-flight slot at every level, or 429."""
        lease = LevelLease(uuid.uuid4().hex, tuple(slots), reserved_tokens, False)
        if not slots:
            return lease
        refusal, lease.in_redis = await self._decide(slots, lease.lease_id, reserved_tokens,
                                                     is_check=False)  # fmt: skip
        if refusal is not None:
            raise self._refuse(refusal)
        self._active[lease.lease_id] = lease
        return lease

    async def finish(
        self, lease: LevelLease, used_tokens: int, *, is_cancelled: bool = False
    ) -> None:
        """Release the lease and give back the unused reservation; ``is_cancelled``: the
        request never ran (a later check refused it), so its request goes back too. Never
        raises for Redis; the second call for a lease does nothing."""
        # Forgotten before any await: even if this is cancelled midway, the lease is no
        # longer renewed and expires.
        if self._active.pop(lease.lease_id, None) is not None:
            await self._settle(lease, used_tokens, is_cancelled)

    def release(self, lease: LevelLease, used_tokens: int) -> None:
        """`finish` without waiting for the store: the lease stops being renewed now and is
        released in the background (for a caller that must not be cancelled halfway
        through its own cleanup)."""
        if self._active.pop(lease.lease_id, None) is not None:
            task = asyncio.create_task(self._settle(lease, used_tokens, False))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _settle(self, lease: LevelLease, used_tokens: int, is_cancelled: bool) -> None:
        unused = lease.reserved_tokens - used_tokens
        if lease.in_redis and self._redis is not None and self._use_redis():
            try:
                await self._redis.finish(
                    lease.slots, lease_id=lease.lease_id, unused_tokens=unused,
                    is_cancelled=is_cancelled,
                )  # fmt: skip
                self._redis_ok()
            except STORE_ERRORS as exc:
                self._redis_failed(exc)  # the Redis lease expires on its own
        elif not lease.in_redis:
            await self._memory.finish(lease.slots, lease_id=lease.lease_id,
                                      unused_tokens=unused, is_cancelled=is_cancelled)  # fmt: skip

    # -- renewing the leases of running requests -----------------------------------------

    def start(self) -> None:
        if self._redis is not None and self._renew_task is None:
            self._renew_task = asyncio.create_task(self._renew_forever())

    async def stop(self) -> None:
        await asyncio.gather(*self._releasing, return_exceptions=True)
        if self._renew_task is not None:
            self._renew_task.cancel()
            await asyncio.gather(self._renew_task, return_exceptions=True)
            self._renew_task = None

    async def renew_once(self) -> None:
        assert self._redis is not None
        held = [(s, x.lease_id) for x in self._active.values() if x.in_redis for s in x.slots]
        if held:
            try:
                await self._redis.renew(held)
            except STORE_ERRORS as exc:
                self._redis_failed(exc)

    async def _renew_forever(self) -> None:
        # Every third of the TTL: two renewals can be missed (a stalled loop, a Redis
        # hiccup) before a live request's lease lapses.
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            await self.renew_once()
