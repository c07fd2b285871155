"""How long a worker's Generate stream may keep a request waiting: pure arithmetic on the
times the caller passes in (no clock, no I/O).

Two deadlines per attempt: the first token within ``first_token_s`` of the call's start,
then each next message within ``stall_s`` of the previous token. A worker whose engine is
wedged keeps its connection (and, until its liveness check trips, its Health) up, so
without these a request would wait for it forever.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# 60 s to the first token: a 1,500-token prompt of the built-in model takes about 6 s of
# a shared 2-core CPU to prefill (docs/benchmarks.md, the PD section), so a request queued
# behind several long ones waits tens of seconds there; a GPU answers in well under 1 s.
# It also exceeds the disaggregated handoff's own limit (transfer_timeout_s, 30 s), which
# fails first and more precisely. The worker's liveness (--engine-stall-timeout-s) is 60 s.
DEFAULT_FIRST_TOKEN_TIMEOUT_S = 60.0
# 30 s between tokens: a decode step of a busy CPU worker takes tens of ms (TPOT P50 59 ms
# with prefill chunks in every step, docs/benchmarks.md), but a preempted request
# recomputes its prompt before its next token: seconds, as for a first token.
DEFAULT_TOKEN_STALL_TIMEOUT_S = 30.0


class DeadlineKind(enum.StrEnum):
    FIRST_TOKEN = "first_token"
    STALL = "token_stall"


@dataclass(frozen=True)
class StreamDeadlines:
    first_token_s: float = DEFAULT_FIRST_TOKEN_TIMEOUT_S
    stall_s: float = DEFAULT_TOKEN_STALL_TIMEOUT_S

    def __post_init__(self) -> None:
        assert self.first_token_s > 0 and self.stall_s > 0, self


@dataclass(frozen=True)
class DeadlineMiss:
    kind: DeadlineKind
    waited_s: float
    limit_s: float

    def describe(self) -> str:
        if self.kind is DeadlineKind.FIRST_TOKEN:
            return (f"no first token within {self.limit_s:g} s "
                    "(the router's --first-token-timeout-s)")  # fmt: skip
        return (f"no token for {self.waited_s:.1f} s after the last one "
                f"(the router's --token-stall-timeout-s is {self.limit_s:g} s)")  # fmt: skip


class StreamClock:
    """One stream's deadline: from ``started_s`` until the first token, then from the
    latest token. Times are seconds on any monotonic clock the caller uses throughout."""

    __slots__ = ("_deadlines", "_last_token_s", "_started_s")

    def __init__(self, deadlines: StreamDeadlines, started_s: float) -> None:
        self._deadlines = deadlines
        self._started_s = started_s
        self._last_token_s: float | None = None

    @property
    def has_token(self) -> bool:
        return self._last_token_s is not None

    def saw_token(self, now_s: float) -> None:
        self._last_token_s = now_s

    def expires_at_s(self) -> float:
        if self._last_token_s is None:
            return self._started_s + self._deadlines.first_token_s
        return self._last_token_s + self._deadlines.stall_s

    def miss(self, now_s: float) -> DeadlineMiss | None:
        """The deadline missed at ``now_s``, or None while the stream is in time."""
        if now_s < self.expires_at_s():
            return None
        if self._last_token_s is None:
            return DeadlineMiss(DeadlineKind.FIRST_TOKEN, now_s - self._started_s,
                                self._deadlines.first_token_s)  # fmt: skip
        return DeadlineMiss(DeadlineKind.STALL, now_s - self._last_token_s,
                            self._deadlines.stall_s)  # fmt: skip
