"""The decision for one level's counters: its request bucket, its token bucket and its
in-flight leases. Pure; the in-process store runs it and the Redis script mirrors it
(redis_store.py); tests hold the two to the same answers.

The buckets are the tenants' (tenants/buckets.py): a per-minute limit with a one-minute
burst; a request takes one request and reserves its worst case of tokens (prompts plus
every choice's max_tokens), and gives back what it did not use when it ends. Unlike a
tenant's, a level's token bucket never asks a request for more than its capacity: one
request larger than a model's whole minute is admitted from a full bucket (and leaves it
in debt) rather than refused forever.

In flight is a set of leases, each with an expiry: a replica renews the leases of its
running requests, so those of a replica that died expire on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvflow.router.limits.levels import Slot
from kvflow.router.tenants.buckets import Bucket, refilled, take

# A request refused for max_in_flight is told to retry after this: a slot frees when any
# running request ends, which nothing here can foresee.
IN_FLIGHT_RETRY_S = 1.0


@dataclass(frozen=True)
class SlotState:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> expiry (s)


@dataclass(frozen=True)
class Refusal:
    slot: Slot
    kind: str  # requests_per_minute, tokens_per_minute or max_in_flight
    retry_after_s: float

    @property
    def limit_name(self) -> str:
        return self.slot.limit_name(self.kind)


def tokens_required(reserved: int, capacity: int) -> float:
    """What the token bucket must hold to admit a reservation: all of it, at least 1, at
    most the bucket's capacity."""
    return float(min(max(1, reserved), capacity))


def live_leases(leases: dict[str, float], now_s: float) -> dict[str, float]:
    return {lease: expiry for lease, expiry in leases.items() if expiry > now_s}


def judge(
    slot: Slot,
    state: SlotState,
    now_s: float,
    *,
    reserved_tokens: int,
    lease_id: str,
    expiry_s: float = math.inf,
) -> tuple[Refusal | None, SlotState]:
    """(None, the state after taking the request) or (the refusal, the state unchanged
    but for expired leases). Checked in the order of KINDS."""
    limits, state = slot.limits, replace(state, leases=live_leases(state.leases, now_s))
    requests, tokens = state.requests, state.tokens
    if limits.requests_per_minute is not None:
        ok, requests, wait_s = take(requests, now_s, limits.requests_per_minute, cost=1, require=1)
        if not ok:
            return Refusal(slot, "requests_per_minute", wait_s), state
    if limits.tokens_per_minute is not None:
        capacity = limits.tokens_per_minute
        ok, tokens, wait_s = take(tokens, now_s, capacity, cost=reserved_tokens,
                                  require=tokens_required(reserved_tokens, capacity))  # fmt: skip
        if not ok:
            return Refusal(slot, "tokens_per_minute", wait_s), state
    leases = state.leases
    if limits.max_in_flight is not None:
        if len(leases) >= limits.max_in_flight:
            return Refusal(slot, "max_in_flight", IN_FLIGHT_RETRY_S), state
        leases = {**leases, lease_id: expiry_s}
    return None, SlotState(requests, tokens, leases)


def settle(
    slot: Slot,
    state: SlotState,
    now_s: float,
    *,
    lease_id: str,
    unused_tokens: int,
    is_cancelled: bool = False,
) -> SlotState:
    """A request ended: its lease goes, its unused reservation goes back to the token
    bucket (negative: it used more, taken now), and a cancelled request (admitted here,
    refused by a later check) gives back its request too."""
    limits = slot.limits
    requests, tokens = state.requests, state.tokens
    if limits.tokens_per_minute is not None:
        tokens = _give_back(tokens, now_s, limits.tokens_per_minute, unused_tokens)
    if is_cancelled and limits.requests_per_minute is not None:
        requests = _give_back(requests, now_s, limits.requests_per_minute, 1)
    leases = {k: v for k, v in state.leases.items() if k != lease_id}
    return SlotState(requests, tokens, leases)


def _give_back(bucket: Bucket | None, now_s: float, capacity: int, amount: float) -> Bucket:
    """Add ``amount`` (negative: take it) to a bucket, in debt or not; the next read caps
    it at the capacity (refilled())."""
    current = refilled(bucket, now_s, capacity)
    return Bucket(current.level + amount, now_s)


def is_idle(slot: Slot, state: SlotState, now_s: float) -> bool:
    """Nothing held and both buckets full again: forgetting the state loses nothing (a
    bucket never seen starts full)."""
    limits = slot.limits
    for bucket, capacity in ((state.requests, limits.requests_per_minute),
                             (state.tokens, limits.tokens_per_minute)):  # fmt: skip
        if bucket is None or capacity is None:
            continue
        if refilled(bucket, now_s, capacity).level < capacity:
            return False
    return not live_leases(state.leases, now_s)


def renew(state: SlotState, lease_id: str, expiry_s: float) -> SlotState:
    """Extend a lease that still exists (an expired one stays gone)."""
    if lease_id not in state.leases:
        return state
    return replace(state, leases={**state.leases, lease_id: expiry_s})
