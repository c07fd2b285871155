"""Numbered KV events: which block hashes became cached or were evicted.

The block pool records events as they happen; the server drains them after each engine
step and fans them out to subscribers. Sequence numbers are consecutive from 1 for one
worker instance, so a subscriber can tell it missed something (and then asks for a
snapshot instead of trusting a gap).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvflow.proto.block_hash import BlockHash


class KvEventKind(enum.Enum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3


@dataclass(frozen=True, slots=True)
class KvEvent:
    seq: int
    kind: KvEventKind
    block_hashes: tuple[BlockHash, ...]


class KvEventLog:
    """Collects events between drains. Consecutive events of one kind are merged.

    Merging keeps a prefill of 500 blocks one event instead of 500, and preserves order:
    a block stored then removed in one step yields STORED then REMOVED.
    """

    def __init__(self) -> None:
        self._last_seq = 0
        self._pending: list[KvEvent] = []

    @property
    def last_seq(self) -> int:
        """The number of the newest event recorded, drained or not."""
        return self._last_seq

    def record(self, kind: KvEventKind, block_hashes: list[BlockHash]) -> None:
        if not block_hashes and kind is not KvEventKind.CLEARED:
            return
        if self._pending and self._pending[-1].kind is kind and kind is not KvEventKind.CLEARED:
            last = self._pending[-1]
            self._pending[-1] = KvEvent(last.seq, kind, last.block_hashes + tuple(block_hashes))
            return
        self._last_seq += 1
        self._pending.append(KvEvent(self._last_seq, kind, tuple(block_hashes)))

    def drain(self) -> list[KvEvent]:
        events, self._pending = self._pending, []
        return events
