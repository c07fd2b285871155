"""Token-bucket and daily-budget arithmetic, shared by the in-process store and mirrored by
the Redis scripts (redis_store.py); tests hold the two to the same answers. Pure.

A bucket of ``capacity`` refills at ``capacity / 60`` per second (a per-minute limit with a
one-minute burst). Admission needs ``require`` units in the bucket and then takes ``cost``,
which may drive the level below zero, so a tenant that overspent waits until the debt is
refilled. The gateway requires and takes a request's worst case (its prompts plus every
choice's max_tokens) and at the end gives back what was not generated: a negative cost,
which never fills the bucket past its capacity (refilled() caps every read).
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class Bucket:
    level: float
    updated_s: float


def refilled(bucket: Bucket | None, now_s: float, capacity: float) -> Bucket:
    """The bucket at ``now_s``; a bucket never seen starts full."""
    if bucket is None:
        return Bucket(capacity, now_s)
    elapsed_s = max(0.0, now_s - bucket.updated_s)
    return Bucket(min(capacity, bucket.level + elapsed_s * capacity / 60.0), now_s)


def seconds_until(bucket: Bucket, require: float, capacity: float) -> float:
    """How long until the bucket holds ``require`` units."""
    missing = require - bucket.level
    return 0.0 if missing <= 0 else missing / (capacity / 60.0)


def take(
    bucket: Bucket | None, now_s: float, capacity: float, *, cost: float, require: float
) -> tuple[bool, Bucket, float]:
    """(admitted, the bucket after, seconds to wait when refused)."""
    current = refilled(bucket, now_s, capacity)
    wait_s = seconds_until(current, require, capacity)
    if wait_s > 0:
        return False, current, wait_s
    # A negative cost gives back what a reservation did not use; the next refilled()
    # caps the level at the capacity again.
    return True, Bucket(current.level - cost, now_s), 0.0


def utc_day(epoch_s: float) -> int:
    return int(epoch_s // SECONDS_PER_DAY)


def seconds_until_next_utc_day(epoch_s: float) -> float:
    return SECONDS_PER_DAY - (epoch_s % SECONDS_PER_DAY)
