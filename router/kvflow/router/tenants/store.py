"""Where quota state lives: the interface, and the in-process store.

The in-process store is what `kvflow up` uses, and what a router falls back to while
Redis is unreachable (limits then hold per replica instead of across replicas).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.router.tenants.buckets import Bucket, seconds_until_next_utc_day, take, utc_day
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.money import judge_budgets, utc_month


@dataclass(frozen=True)
class Admission:
    is_admitted: bool
    # Which quota refused it: requests_per_minute, tokens_per_minute,
    # max_concurrent_requests, daily_token_budget, daily_budget_usd or monthly_budget_usd.
    limit: str | None = None
    retry_after_s: float = 0.0
    # Admitted, but spend is past a budget's warning fraction: "daily 82% of 10.00 USD".
    budget_warning: str | None = None
    warning_budget: str | None = None  # daily or monthly


ADMITTED = Admission(True)


@dataclass
class UsageTotals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spend_pusd: int = 0  # pico-USD (tenants/money.py)

    def as_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "spend_pusd": self.spend_pusd,
        }


class QuotaStore(Protocol):
    async def admit(
        self,
        tenant: Tenant,
        *,
        lease_id: str,
        prompt_tokens: int,
        reserved_tokens: int | None = None,
    ) -> Admission:
        """Check every quota and, only if all pass, take a request, the reserved tokens
        (prompts + every choice's max_tokens; None: the prompt's alone) and a concurrency
        lease, atomically. The token bucket must hold all the reserved tokens (at least 1).
        Raises ConnectionError-like errors when the store is unreachable (the caller falls
        back)."""
        ...

    async def check(self, tenant: Tenant, *, reserved_tokens: int) -> Admission:
        """What `admit` would answer for a request reserving ``reserved_tokens``, taking
        nothing: the gateway asks before preparing a request's prompts, so a tenant over
        its limits is refused before its prompts cost anything (api/job_start.py)."""
        ...

    async def finish(
        self,
        tenant: Tenant,
        *,
        lease_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        reserved_tokens: int | None = None,
        usage: UsageTotals | None = None,
    ) -> None:
        """Release the lease; per minute, charge what was used beyond the reservation (give
        back what was not, up to a full bucket); daily, charge all tokens used; and add
        ``usage`` to the tenant's totals in the same step (one round trip to Redis)."""
        ...

    async def add_usage(self, tenant: Tenant, usage: UsageTotals) -> None: ...

    async def read_usage(self, tenant: Tenant) -> UsageTotals: ...


@dataclass
class _TenantState:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    leases: set[str] = field(default_factory=set)
    day: int = -1
    day_tokens: int = 0
    day_spend_pusd: int = 0
    month: int = -1
    month_spend_pusd: int = 0
    usage: UsageTotals = field(default_factory=UsageTotals)


class MemoryQuotaStore:
    """Quota state in this process. Single-threaded (the event loop), so atomic as is."""

    def __init__(self, clock_s: Callable[[], float] = time.time) -> None:
        self._clock_s = clock_s
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: Tenant) -> _TenantState:
        return self._states.setdefault(tenant.name, _TenantState())

    def _roll_day(self, state: _TenantState, now_s: float) -> None:
        if state.day != utc_day(now_s):
            state.day, state.day_tokens, state.day_spend_pusd = utc_day(now_s), 0, 0
        if state.month != utc_month(now_s):
            state.month, state.month_spend_pusd = utc_month(now_s), 0

    async def admit(
        self,
        tenant: Tenant,
        *,
        lease_id: str,
        prompt_tokens: int,
        reserved_tokens: int | None = None,
    ) -> Admission:
        reserved = prompt_tokens if reserved_tokens is None else reserved_tokens
        state = self._state(tenant)
        admission, new_requests, new_tokens = self._decide(tenant, state, reserved)
        if admission.is_admitted:
            state.requests, state.tokens = new_requests, new_tokens
            state.leases.add(lease_id)
        return admission

    async def check(self, tenant: Tenant, *, reserved_tokens: int) -> Admission:
        return self._decide(tenant, self._state(tenant), reserved_tokens)[0]

    def _decide(
        self, tenant: Tenant, state: _TenantState, reserved: int
    ) -> tuple[Admission, Bucket | None, Bucket | None]:
        """The decision, and the buckets as they would be after taking the request."""
        q, now_s = tenant.quotas, self._clock_s()
        self._roll_day(state, now_s)
        new_requests, new_tokens = state.requests, state.tokens
        if q.requests_per_minute is not None:
            ok, new_requests, wait_s = take(
                state.requests, now_s, q.requests_per_minute, cost=1, require=1
            )
            if not ok:
                return Admission(False, "requests_per_minute", wait_s), None, None
        if q.tokens_per_minute is not None:
            ok, new_tokens, wait_s = take(
                state.tokens, now_s, q.tokens_per_minute, cost=reserved, require=max(1, reserved)
            )
            if not ok:
                return Admission(False, "tokens_per_minute", wait_s), None, None
        if q.max_concurrent_requests is not None and (
            len(state.leases) >= q.max_concurrent_requests
        ):
            return Admission(False, "max_concurrent_requests", 1.0), None, None
        if q.daily_token_budget is not None and state.day_tokens >= q.daily_token_budget:
            wait_s = seconds_until_next_utc_day(now_s)
            return Admission(False, "daily_token_budget", wait_s), None, None
        verdict = judge_budgets(
            q.budgets,
            day_pusd=state.day_spend_pusd,
            month_pusd=state.month_spend_pusd,
            now_s=now_s,
        )
        if verdict.exceeded is not None:
            return Admission(False, verdict.exceeded, verdict.retry_after_s), None, None
        if verdict.warning is not None:
            admission = Admission(
                True, budget_warning=verdict.warning, warning_budget=verdict.warning_budget
            )
            return admission, new_requests, new_tokens
        return ADMITTED, new_requests, new_tokens

    async def finish(
        self,
        tenant: Tenant,
        *,
        lease_id: str,
        prompt_tokens: int,
        completion_tokens: int,
        reserved_tokens: int | None = None,
        usage: UsageTotals | None = None,
    ) -> None:
        q, state, now_s = tenant.quotas, self._state(tenant), self._clock_s()
        if usage is not None:
            await self.add_usage(tenant, usage)
        state.leases.discard(lease_id)
        reserved = prompt_tokens if reserved_tokens is None else reserved_tokens
        if q.tokens_per_minute is not None:
            used = prompt_tokens + completion_tokens
            _, state.tokens, _ = take(
                state.tokens, now_s, q.tokens_per_minute, cost=used - reserved, require=0
            )
        self._roll_day(state, now_s)
        state.day_tokens += prompt_tokens + completion_tokens
        if usage is not None:
            state.day_spend_pusd += usage.spend_pusd
            state.month_spend_pusd += usage.spend_pusd

    async def add_usage(self, tenant: Tenant, usage: UsageTotals) -> None:
        total = self._state(tenant).usage
        total.requests += usage.requests
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.cached_tokens += usage.cached_tokens
        total.spend_pusd += usage.spend_pusd

    async def read_usage(self, tenant: Tenant) -> UsageTotals:
        u = self._state(tenant).usage
        return UsageTotals(
            u.requests, u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.spend_pusd
        )
