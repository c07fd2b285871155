"""One batch's lines as the runner that holds it knows them (batch/runner.py): those to
run, those in flight, and the batch's own back-off after a refusal."""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any

from kvflow.router.batch.jsonl import BatchLine

MAX_BACKOFF_S = 30.0


class InputLostError(Exception):
    """A running batch's lines cannot be read again (after a restart or a lost lease)."""

    def __init__(self, *problems: dict[str, Any]) -> None:
        super().__init__(problems)
        self.problems = problems


def problem(code: str, param: str | None, message: str) -> dict[str, Any]:
    return {"code": code, "param": param, "line": None, "message": message}


@dataclass(frozen=True)
class Retry:
    """A line refused for now (429/503): put back, not a result."""

    retry_after_s: float | None


class RunningBatch:
    """One batch's lines as this router knows them."""

    def __init__(self, lines: tuple[BatchLine, ...], done: set[int], backoff_s: float) -> None:
        self.lines = lines
        self.pending = collections.deque(ln.index for ln in lines if ln.index not in done)
        self.in_flight: dict[int, asyncio.Task[None]] = {}
        # This batch's own hold: a refusal is its tenant's (a quota) or its pool's (busy,
        # admission), never a reason to hold another tenant's batch.
        self.hold_until = 0.0  # monotonic: no new line of this batch before
        self.backoff_s = backoff_s
        self.base_backoff_s = backoff_s

    def back_off(self, retry_after_s: float | None) -> None:
        wait_s = max(self.backoff_s, retry_after_s or 0.0)
        self.hold_until = time.monotonic() + wait_s
        self.backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2)
