"""Where the levels' counters live: the interface, and the in-process store.

The in-process store serves a single replica (no --redis-url), and any replica while Redis
is unreachable (the limits then hold per replica). Its leases never expire: they live and
die with the process that holds them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvflow.router.limits.decide import Refusal, SlotState, is_idle, judge, settle
from kvflow.router.limits.levels import Slot

# How often idle counters are dropped: one per client address ever seen would otherwise
# grow without bound.
SWEEP_INTERVAL_S = 60.0


class LimitStore(Protocol):
    async def admit(
        self, slots: Sequence[Slot], *, lease_id: str, reserved_tokens: int, is_check: bool
    ) -> Refusal | None:
        """Check every slot in order and, only if all pass and not ``is_check``, take a
        request, ``reserved_tokens`` and an in-flight lease from each, atomically. The
        first refusal, or None. Raises ConnectionError-like errors when unreachable."""
        ...

    async def finish(
        self, slots: Sequence[Slot], *, lease_id: str, unused_tokens: int, is_cancelled: bool
    ) -> None:
        """Release the lease in each slot and give back what the request did not use
        (decide.settle)."""
        ...

    async def renew(self, leases: Sequence[tuple[Slot, str]]) -> None:
        """Extend each (slot, lease id) that still exists by the lease TTL."""
        ...


class MemoryLimitStore:
    """Counters in this process. Single-threaded (the event loop), so atomic as is."""

    def __init__(self, clock_s: Callable[[], float] = time.monotonic) -> None:
        self._clock_s = clock_s
        self._states: dict[tuple[str, str], SlotState] = {}
        self._slots: dict[tuple[str, str], Slot] = {}
        self._swept_s = clock_s()

    def _sweep(self, now_s: float) -> None:
        if now_s - self._swept_s < SWEEP_INTERVAL_S:
            return
        self._swept_s = now_s
        for key, state in list(self._states.items()):
            if is_idle(self._slots[key], state, now_s):
                del self._states[key], self._slots[key]

    async def admit(
        self, slots: Sequence[Slot], *, lease_id: str, reserved_tokens: int, is_check: bool
    ) -> Refusal | None:
        now_s, after = self._clock_s(), []
        self._sweep(now_s)
        for slot in slots:
            state = self._states.get((slot.level, slot.key), SlotState())
            refusal, new_state = judge(
                slot, state, now_s, reserved_tokens=reserved_tokens, lease_id=lease_id
            )
            if refusal is not None:
                return refusal
            after.append((slot, new_state))
        if not is_check:
            for slot, new_state in after:
                self._states[slot.level, slot.key] = new_state
                self._slots[slot.level, slot.key] = slot
        return None

    async def finish(
        self, slots: Sequence[Slot], *, lease_id: str, unused_tokens: int, is_cancelled: bool
    ) -> None:
        now_s = self._clock_s()
        for slot in slots:
            state = self._states.get((slot.level, slot.key), SlotState())
            self._slots[slot.level, slot.key] = slot
            self._states[slot.level, slot.key] = settle(
                slot, state, now_s, lease_id=lease_id, unused_tokens=unused_tokens,
                is_cancelled=is_cancelled,
            )  # fmt: skip

    async def renew(self, leases: Sequence[tuple[Slot, str]]) -> None:
        return None  # never expire here

    def num_counters(self) -> int:
        return len(self._states)
