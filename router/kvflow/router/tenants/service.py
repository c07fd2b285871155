"""Quotas for the gateway: Redis when configured and reachable, this process otherwise.

When Redis fails, `on_store_failure` says what happens to the requests meanwhile:
"memory" (the default) admits them against the in-process store: nothing fails, but the
limits hold per replica, and the in-process daily budget starts from zero (what Redis
counted today is not known here); "deny" answers 503 with Retry-After instead, for
operators whose limits are a contract (or a bill). Either way the first failure logs a
warning, each decision taken without Redis counts in
kvflow_router_quota_store_fallbacks_total, Redis is tried again after RETRY_REDIS_AFTER_S,
and its return is logged too.

The daily budget is counted per UTC day in Redis (redis_store.py), so it survives a router
restart; without Redis it lives in this process and a restart starts it from zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.router.protocol.errors import ApiError
from kvflow.router.store_errors import STORE_ERRORS
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.redis_store import LEASE_REFRESH_S, RedisQuotaStore
from kvflow.router.tenants.store import Admission, MemoryQuotaStore, UsageTotals

log = logging.getLogger("kvflow.router.quotas")

RETRY_REDIS_AFTER_S = 2.0
# Redis errors, and the OS-level ones a dropped connection raises before redis-py wraps them.


@dataclass
class Lease:
    """One admitted request's hold on its tenant's quotas, released by `QuotaService.finish`."""

    tenant: Tenant
    lease_id: str
    prompt_tokens: int
    in_redis: bool
    # Taken from the token bucket at admission: the prompts plus every choice's max_tokens;
    # what the request does not generate is given back by `finish`.
    reserved_tokens: int | None = None


STORE_FAILURE_MODES = ("memory", "deny")


def quota_store_unavailable() -> ApiError:
    return ApiError(
        503,
        "The gateway cannot reach its quota store (Redis) and is configured to refuse "
        "requests meanwhile (--quota-on-store-failure deny); retry shortly.",
        type="server_error",
        code="quota_store_unavailable",
        retry_after_s=RETRY_REDIS_AFTER_S,
    )


class QuotaService:
    def __init__(
        self,
        redis_store: RedisQuotaStore | None,
        *,
        on_store_failure: str = "memory",
        on_fallback: Callable[[str], None] = lambda action: None,
    ) -> None:
        """``on_fallback(action)``: called for each decision taken without Redis."""
        assert on_store_failure in STORE_FAILURE_MODES, on_store_failure
        self._redis = redis_store
        self._is_deny = on_store_failure == "deny"
        self._on_fallback = on_fallback
        self._memory = MemoryQuotaStore()
        self._redis_down_until_s = 0.0
        self._active: dict[str, Lease] = {}
        self._refresh_task: asyncio.Task[None] | None = None

    @property
    def scope(self) -> str:
        """ "cluster" while limits are shared through Redis, "replica" otherwise."""
        return "cluster" if self._use_redis() else "replica"

    def _use_redis(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._redis_down_until_s

    def _redis_failed(self, exc: BaseException) -> None:
        if self._redis_down_until_s == 0.0:
            log.warning(
                "Redis is unreachable (%s): quotas and rate limits now hold per router "
                "replica until it is back",
                exc,
            )
        self._redis_down_until_s = time.monotonic() + RETRY_REDIS_AFTER_S

    def _redis_ok(self) -> None:
        if self._redis_down_until_s != 0.0:
            log.warning("Redis is reachable again: quotas are shared across replicas again")
            self._redis_down_until_s = 0.0

    async def admit(
        self, tenant: Tenant, prompt_tokens: int, reserved_tokens: int | None = None
    ) -> tuple[Admission, Lease]:
        """Admit a request whose prompts hold ``prompt_tokens`` and which may use up to
        ``reserved_tokens`` in all (None: the prompts' alone)."""
        lease = Lease(tenant, uuid.uuid4().hex, prompt_tokens, False, reserved_tokens)
        if self._redis is not None and self._use_redis():
            try:
                admission = await self._redis.admit(
                    tenant,
                    lease_id=lease.lease_id,
                    prompt_tokens=prompt_tokens,
                    reserved_tokens=reserved_tokens,
                )
                self._redis_ok()
                lease.in_redis = True
            except STORE_ERRORS as exc:
                self._redis_failed(exc)
            else:
                if admission.is_admitted:
                    self._active[lease.lease_id] = lease
                return admission, lease
        if self._redis is not None:
            self._on_fallback("deny" if self._is_deny else "memory")
            if self._is_deny:
                raise quota_store_unavailable()
        admission = await self._memory.admit(
            tenant,
            lease_id=lease.lease_id,
            prompt_tokens=prompt_tokens,
            reserved_tokens=reserved_tokens,
        )
        if admission.is_admitted:
            self._active[lease.lease_id] = lease
        return admission, lease

    async def check(self, tenant: Tenant, reserved_tokens: int) -> Admission:
        """What `admit` would answer for a request reserving ``reserved_tokens``, taking
        nothing (the store's `check`). The same store and the same fallback as `admit`."""
        if self._redis is not None and self._use_redis():
            try:
                admission = await self._redis.check(tenant, reserved_tokens=reserved_tokens)
                self._redis_ok()
            except STORE_ERRORS as exc:
                self._redis_failed(exc)
            else:
                return admission
        if self._redis is not None:
            self._on_fallback("deny" if self._is_deny else "memory")
            if self._is_deny:
                raise quota_store_unavailable()
        return await self._memory.check(tenant, reserved_tokens=reserved_tokens)

    async def finish(self, lease: Lease, usage: UsageTotals) -> None:
        """Release the lease and record what the request used; never raises for Redis."""
        if self._active.pop(lease.lease_id, None) is None:
            return  # never admitted, or already finished
        usage.requests = 1
        tenant, lease_id, prompt = lease.tenant, lease.lease_id, lease.prompt_tokens
        completion, reserved = usage.completion_tokens, lease.reserved_tokens
        if lease.in_redis and self._redis is not None and self._use_redis():
            try:
                await self._redis.finish(
                    tenant,
                    lease_id=lease_id,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    reserved_tokens=reserved,
                    usage=usage,
                )
                self._redis_ok()
                return
            except STORE_ERRORS as exc:
                self._redis_failed(exc)  # the Redis lease expires on its own
        await self._memory.finish(
            tenant,
            lease_id=lease_id,
            prompt_tokens=prompt,
            completion_tokens=completion,
            reserved_tokens=reserved,
            usage=usage,
        )

    async def read_usage(self, tenant: Tenant) -> tuple[UsageTotals, str]:
        """The tenant's totals and their scope ("cluster" from Redis, else "replica")."""
        if self._redis is not None and self._use_redis():
            try:
                totals = await self._redis.read_usage(tenant)
                self._redis_ok()
                return totals, "cluster"
            except STORE_ERRORS as exc:
                self._redis_failed(exc)
        return await self._memory.read_usage(tenant), "replica"

    # -- lease refresh for long streams ------------------------------------------------------

    def start(self) -> None:
        if self._redis is not None and self._refresh_task is None:
            self._refresh_task = asyncio.create_task(self._refresh_leases_forever())

    async def stop(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            await asyncio.gather(self._refresh_task, return_exceptions=True)
            self._refresh_task = None

    async def _refresh_leases_forever(self) -> None:
        assert self._redis is not None
        while True:
            await asyncio.sleep(LEASE_REFRESH_S)
            by_tenant: dict[str, list[Lease]] = {}
            for lease in self._active.values():
                if lease.in_redis:
                    by_tenant.setdefault(lease.tenant.name, []).append(lease)
            for leases in by_tenant.values():
                try:
                    await self._redis.refresh_leases(leases[0].tenant, (x.lease_id for x in leases))
                except STORE_ERRORS as exc:
                    self._redis_failed(exc)
