"""The levels' counters in Redis, shared by every router replica.

The tenants' patterns (tenants/redis_store.py): each decision is one Lua script, so
checking every level and taking from all of them is atomic across replicas, on Redis's
clock, with the same bucket arithmetic (decide.py mirrors it). In flight is a sorted set of
leases scored by expiry; the replica holding a lease renews it every third of the TTL
(service.py), so a replica that dies mid-request frees its slots within the TTL.

Keys: ``kvflow:SCOPE:limits:{levels}:LEVEL:KEY:WHAT`` (SCOPE from --quota-scope). The one
hash tag puts every level's keys in one slot, as a script touching several levels needs
if this ever meets Redis Cluster; a tenant's keys (``kvflow:SCOPE:{TENANT}:...``) never
collide with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from redis.asyncio import Redis

from kvflow.router.limits.decide import Refusal
from kvflow.router.limits.levels import Slot
from kvflow.router.tenants.quota_scope import DEFAULT_QUOTA_SCOPE
from kvflow.router.tenants.redis_store import _REFILL as REFILL_LUA

# A bucket is kept until it has refilled, and a while longer: a request reserving more than a
# level's minute leaves a debt that takes minutes to refill (decide.py), which the tenants'
# fixed expiry would forgive early.
_KEEP = """
local function keep(key, level, capacity, now)
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
  local refill_ms = math.ceil(math.max(0, capacity - level) * 60000 / capacity)
  redis.call('PEXPIRE', key, math.max(BUCKET_TTL_MS, refill_ms + 60000))
end
"""

# KEYS: per slot, in checking order: requests bucket, tokens bucket, leases zset
# ARGV: 1 only check (take nothing), else 0; lease id; lease ttl s; reserved tokens; then
#       per slot: requests per minute, tokens per minute, max in flight (0 = unlimited)
# Returns {1} or {0, the refusing slot's index (from 1), limit kind, retry after in ms}.
_ADMIT = (
    REFILL_LUA
    + _KEEP
    + """
local now = now_s()
local is_check, lease = ARGV[1] == '1', ARGV[2]
local ttl, reserved = tonumber(ARGV[3]), tonumber(ARGV[4])
local taken = {}
for i = 1, #KEYS / 3 do
  local k, a = (i - 1) * 3, 4 + (i - 1) * 3
  local rpm, tpm, conc = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local req_level, tok_level = 0, 0
  if rpm > 0 then
    req_level = refilled(KEYS[k + 1], rpm, now)
    if req_level < 1 then
      return {0, i, 'requests_per_minute', math.ceil((1 - req_level) * 60000 / rpm)}
    end
  end
  if tpm > 0 then
    local need = math.min(math.max(1, reserved), tpm)
    tok_level = refilled(KEYS[k + 2], tpm, now)
    if tok_level < need then
      return {0, i, 'tokens_per_minute', math.ceil((need - tok_level) * 60000 / tpm)}
    end
  end
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', now)
    if redis.call('ZCARD', KEYS[k + 3]) >= conc then return {0, i, 'max_in_flight', 1000} end
  end
  taken[i] = {rpm, tpm, conc, req_level, tok_level}
end
if is_check then return {1} end
for i, t in ipairs(taken) do
  local k = (i - 1) * 3
  if t[1] > 0 then keep(KEYS[k + 1], t[4] - 1, t[1], now) end
  if t[2] > 0 then keep(KEYS[k + 2], t[5] - reserved, t[2], now) end
  if t[3] > 0 then
    redis.call('ZADD', KEYS[k + 3], now + ttl, lease)
    redis.call('PEXPIRE', KEYS[k + 3], math.ceil(ttl * 1000))
  end
end
return {1}
"""
)

# KEYS: as _ADMIT's
# ARGV: lease id; unused tokens (negative: used beyond the reservation); 1 if cancelled
#       (give back the request too) else 0; then per slot: requests and tokens per minute
_FINISH = (
    REFILL_LUA
    + _KEEP
    + """
local now = now_s()
local lease, unused, is_cancelled = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
for i = 1, #KEYS / 3 do
  local k, a = (i - 1) * 3, 3 + (i - 1) * 2
  local rpm, tpm = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  redis.call('ZREM', KEYS[k + 3], lease)
  if tpm > 0 then keep(KEYS[k + 2], refilled(KEYS[k + 2], tpm, now) + unused, tpm, now) end
  if is_cancelled and rpm > 0 then
    keep(KEYS[k + 1], refilled(KEYS[k + 1], rpm, now) + 1, rpm, now)
  end
end
return 1
"""
)

# KEYS: leases zsets; ARGV: ttl s, then the lease id for each key. Extends only leases that
# still exist (one that expired stays gone: its slot may be someone else's by now), and
# the set itself, which would otherwise expire under a long request's lease.
_RENEW = """
local t = redis.call('TIME')
local ttl = tonumber(ARGV[1])
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + ttl
for i = 1, #KEYS do
  if redis.call('ZADD', KEYS[i], 'XX', 'CH', expiry, ARGV[i + 1]) == 1 then
    redis.call('PEXPIRE', KEYS[i], math.ceil(ttl * 1000))
  end
end
return 1
"""


class RedisLimitStore:
    def __init__(
        self, redis: Redis, *, lease_ttl_s: float, scope: str = DEFAULT_QUOTA_SCOPE
    ) -> None:
        self._prefix = f"kvflow:{scope}:limits:{{levels}}"
        self._lease_ttl_s = lease_ttl_s
        self._admit = redis.register_script(_ADMIT)
        self._finish = redis.register_script(_FINISH)
        self._renew = redis.register_script(_RENEW)

    def key(self, slot: Slot, what: str) -> str:
        return f"{self._prefix}:{slot.level}:{slot.key}:{what}"

    def _keys(self, slots: Sequence[Slot]) -> list[str]:
        return [self.key(s, what) for s in slots for what in ("requests", "tokens", "leases")]

    async def admit(
        self, slots: Sequence[Slot], *, lease_id: str, reserved_tokens: int, is_check: bool
    ) -> Refusal | None:
        args: list[str | int | float] = [
            1 if is_check else 0, lease_id, self._lease_ttl_s, reserved_tokens
        ]  # fmt: skip
        for s in slots:
            limits = s.limits
            args += [limits.requests_per_minute or 0, limits.tokens_per_minute or 0,
                     limits.max_in_flight or 0]  # fmt: skip
        result = await self._admit(keys=self._keys(slots), args=args)
        if int(result[0]) == 1:
            return None
        kind = result[2].decode() if isinstance(result[2], bytes) else str(result[2])
        return Refusal(slots[int(result[1]) - 1], kind, int(result[3]) / 1000.0)

    async def finish(
        self, slots: Sequence[Slot], *, lease_id: str, unused_tokens: int, is_cancelled: bool
    ) -> None:
        args: list[str | int] = [lease_id, unused_tokens, 1 if is_cancelled else 0]
        for s in slots:
            args += [s.limits.requests_per_minute or 0, s.limits.tokens_per_minute or 0]
        await self._finish(keys=self._keys(slots), args=args)

    async def renew(self, leases: Sequence[tuple[Slot, str]]) -> None:
        held = [(s, lease) for s, lease in leases if s.limits.max_in_flight is not None]
        if held:
            await self._renew(
                keys=[self.key(s, "leases") for s, _ in held],
                args=[math.ceil(self._lease_ttl_s * 1000) / 1000, *(lease for _, lease in held)],
            )
