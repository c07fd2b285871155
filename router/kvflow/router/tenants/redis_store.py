"""Quota state in Redis, shared by every router replica.

Each decision is one Lua script, so checking four quotas and taking from all of them is
atomic across replicas without locks. The scripts read Redis's own clock (TIME), so
replicas with skewed clocks still agree on refill. The arithmetic mirrors buckets.py.

Concurrency is a sorted set of leases scored by expiry: a replica that dies without
releasing its leases frees them within LEASE_TTL_S, and a live replica refreshes the
leases of its long streams every LEASE_REFRESH_S.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis.asyncio import Redis

from kvflow.router.tenants.buckets import SECONDS_PER_DAY, utc_day
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.money import judge_budgets, seconds_until_next_utc_month, utc_month
from kvflow.router.tenants.quota_scope import DEFAULT_QUOTA_SCOPE
from kvflow.router.tenants.store import ADMITTED, Admission, UsageTotals

# Quota keys are namespaced by a scope (`--quota-scope`): routers of two pools sharing one
# Redis keep their tenants' counters apart, even for tenants of the same name.

# A lease outlives a dead replica by at most 60 s; refreshing every 20 s survives two
# missed refreshes (a slow event loop) before a live stream's lease could lapse.
LEASE_TTL_S = 60.0
LEASE_REFRESH_S = 20.0
# Idle buckets expire after 2 minutes: a full refill takes 1, so nothing is lost.
_BUCKET_TTL_MS = 120_000

_REFILL = (
    f"local BUCKET_TTL_MS = {_BUCKET_TTL_MS}\n"
    + """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function refilled(key, capacity, now)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if level == nil then return capacity end
  return math.min(capacity, level + math.max(0, now - ts) * capacity / 60)
end
"""
)

# KEYS: requests bucket, tokens bucket, leases zset, daily tokens counter, daily spend
#       counter, monthly spend counter (pico-USD)
# ARGV: rpm, tpm, max concurrent, daily budget (0 = unlimited), reserved tokens, lease id,
#       lease ttl s, seconds to the next UTC day, 1 to only check (take nothing) else 0,
#       daily and monthly budgets in pico-USD (0 = none), seconds to the next UTC month
# Returns {1, day's spend, month's spend} or {0, limit name, retry after in ms}. The spends
# come back as Redis holds them (decimal strings) so the warning is judged on exact integers;
# the comparison here is in Lua's doubles, exact below 2^53 pico-USD (about 9000 USD) and
# off by far less than a cent above.
_ADMIT = (
    _REFILL
    + """
local now = now_s()
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local conc, daily = tonumber(ARGV[3]), tonumber(ARGV[4])
local reserved = tonumber(ARGV[5])
local need = math.max(1, reserved)
local req_level, tok_level = 0, 0
if rpm > 0 then
  req_level = refilled(KEYS[1], rpm, now)
  if req_level < 1 then
    return {0, 'requests_per_minute', math.ceil((1 - req_level) * 60000 / rpm)}
  end
end
if tpm > 0 then
  tok_level = refilled(KEYS[2], tpm, now)
  if tok_level < need then
    return {0, 'tokens_per_minute', math.ceil((need - tok_level) * 60000 / tpm)}
  end
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 'max_concurrent_requests', 1000} end
end
if daily > 0 then
  local used = tonumber(redis.call('GET', KEYS[4]) or '0')
  if used >= daily then
    return {0, 'daily_token_budget', math.ceil(tonumber(ARGV[8]) * 1000)}
  end
end
local day_spend = redis.call('GET', KEYS[5]) or '0'
local month_spend = redis.call('GET', KEYS[6]) or '0'
local day_budget, month_budget = tonumber(ARGV[10]), tonumber(ARGV[11])
if day_budget > 0 and tonumber(day_spend) >= day_budget then
  return {0, 'daily_budget_usd', math.ceil(tonumber(ARGV[8]) * 1000)}
end
if month_budget > 0 and tonumber(month_spend) >= month_budget then
  return {0, 'monthly_budget_usd', math.ceil(tonumber(ARGV[12]) * 1000)}
end
if ARGV[9] == '1' then return {1, day_spend, month_spend} end
if rpm > 0 then
  redis.call('HSET', KEYS[1], 'level', tostring(req_level - 1), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], BUCKET_TTL_MS)
end
if tpm > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(tok_level - reserved), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[2], BUCKET_TTL_MS)
end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[7]), ARGV[6])
  redis.call('PEXPIRE', KEYS[3], math.ceil(tonumber(ARGV[7]) * 1000))
end
return {1, day_spend, month_spend}
"""
)

# KEYS: tokens bucket, leases zset, daily tokens counter, usage totals hash, daily spend
#       counter, monthly spend counter
# ARGV: tpm (0 = unlimited), tokens used beyond the reservation (negative: given back),
#       lease id, prompt + completion tokens, daily counter ttl s, spend in pico-USD,
#       monthly counter ttl s, then usage field/count pairs to add (the usage rides along:
#       one round trip per request instead of two)
_FINISH = (
    _REFILL
    + """
local now = now_s()
local tpm = tonumber(ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[3])
if tpm > 0 then
  local level = refilled(KEYS[1], tpm, now) - tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], BUCKET_TTL_MS)
end
redis.call('INCRBY', KEYS[3], ARGV[4])
redis.call('EXPIRE', KEYS[3], ARGV[5])
if ARGV[6] ~= '0' then
  redis.call('INCRBY', KEYS[5], ARGV[6])
  redis.call('EXPIRE', KEYS[5], ARGV[5])
  redis.call('INCRBY', KEYS[6], ARGV[6])
  redis.call('EXPIRE', KEYS[6], ARGV[7])
end
for i = 8, #ARGV, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
return 1
"""
)

# KEYS: leases zset; ARGV: ttl s, lease ids...  Extends only leases that still exist, and
# the set itself: it expires a TTL after the last admission, and a stream longer than that
# with no admission after it would otherwise lose its lease with the set.
_REFRESH = """
local t = redis.call('TIME')
local ttl = tonumber(ARGV[1])
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + ttl
local renewed = 0
for i = 2, #ARGV do renewed = renewed + redis.call('ZADD', KEYS[1], 'XX', 'CH', expiry, ARGV[i]) end
if renewed > 0 and redis.call('PTTL', KEYS[1]) < ttl * 1000 then
  redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000))
end
return 1
"""

_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "spend_pusd")
# Last month's spend counter lingers a month, then goes.
_MONTH_TTL_S = 62 * SECONDS_PER_DAY


class RedisQuotaStore:
    def __init__(self, redis: Redis, *, scope: str = DEFAULT_QUOTA_SCOPE) -> None:
        self._redis = redis
        self._prefix = f"kvflow:{scope}"
        self._admit = redis.register_script(_ADMIT)
        self._finish = redis.register_script(_FINISH)
        self._refresh = redis.register_script(_REFRESH)

    def _key(self, tenant: Tenant, what: str) -> str:
        # kvflow:SCOPE:{TENANT}:WHAT. The tenant name in braces: one hash slot per tenant if
        # this ever meets Redis Cluster.
        return f"{self._prefix}:{{{tenant.name}}}:{what}"

    def _daily_key(self, tenant: Tenant) -> str:
        return self._key(tenant, f"day:{utc_day(time.time())}")

    def _spend_keys(self, tenant: Tenant) -> list[str]:
        now_s = time.time()
        return [
            self._key(tenant, f"spend:day:{utc_day(now_s)}"),
            self._key(tenant, f"spend:month:{utc_month(now_s)}"),
        ]

    async def admit(
        self,
        tenant: Tenant,
        *,
        lease_id: str,
        prompt_tokens: int,
        reserved_tokens: int | None = None,
    ) -> Admission:
        reserved = prompt_tokens if reserved_tokens is None else reserved_tokens
        return await self._run_admit(tenant, reserved, lease_id, is_check=False)

    async def check(self, tenant: Tenant, *, reserved_tokens: int) -> Admission:
        return await self._run_admit(tenant, reserved_tokens, "", is_check=True)

    async def _run_admit(
        self, tenant: Tenant, reserved: int, lease_id: str, *, is_check: bool
    ) -> Admission:
        q = tenant.quotas
        result = await self._admit(
            keys=[
                self._key(tenant, "requests"),
                self._key(tenant, "tokens"),
                self._key(tenant, "leases"),
                self._daily_key(tenant),
                *self._spend_keys(tenant),
            ],
            args=[
                q.requests_per_minute or 0,
                q.tokens_per_minute or 0,
                q.max_concurrent_requests or 0,
                q.daily_token_budget or 0,
                reserved,
                lease_id,
                LEASE_TTL_S,
                SECONDS_PER_DAY - time.time() % SECONDS_PER_DAY,
                1 if is_check else 0,
                q.budgets.daily_pusd or 0,
                q.budgets.monthly_pusd or 0,
                seconds_until_next_utc_month(time.time()),
            ],
        )
        if int(result[0]) == 1:
            verdict = judge_budgets(
                q.budgets, day_pusd=int(result[1]), month_pusd=int(result[2]), now_s=time.time()
            )
            if verdict.warning is None:
                return ADMITTED
            return Admission(
                True, budget_warning=verdict.warning, warning_budget=verdict.warning_budget
            )
        limit = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        return Admission(False, limit, int(result[2]) / 1000.0)

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
        reserved = prompt_tokens if reserved_tokens is None else reserved_tokens
        counts: list[str | int] = []
        for name, count in (usage.as_dict() if usage else {}).items():
            if count:
                counts += [name, count]
        await self._finish(
            keys=[
                self._key(tenant, "tokens"),
                self._key(tenant, "leases"),
                self._daily_key(tenant),
                self._key(tenant, "usage"),
                *self._spend_keys(tenant),
            ],
            args=[
                tenant.quotas.tokens_per_minute or 0,
                prompt_tokens + completion_tokens - reserved,
                lease_id,
                prompt_tokens + completion_tokens,
                2 * SECONDS_PER_DAY,  # yesterday's counter lingers a day, then goes
                usage.spend_pusd if usage else 0,
                _MONTH_TTL_S,
                *counts,
            ],
        )

    async def refresh_leases(self, tenant: Tenant, lease_ids: Iterable[str]) -> None:
        ids = list(lease_ids)
        if ids:
            await self._refresh(keys=[self._key(tenant, "leases")], args=[LEASE_TTL_S, *ids])

    async def add_usage(self, tenant: Tenant, usage: UsageTotals) -> None:
        key = self._key(tenant, "usage")
        pipe = self._redis.pipeline(transaction=False)
        for name, value in usage.as_dict().items():
            if value:
                pipe.hincrby(key, name, value)
        await pipe.execute()

    async def read_usage(self, tenant: Tenant) -> UsageTotals:
        values = await self._redis.hmget(self._key(tenant, "usage"), list(_USAGE_FIELDS))
        counts = [int(v) if v is not None else 0 for v in values]
        return UsageTotals(*counts)
