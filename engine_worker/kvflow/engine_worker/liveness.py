"""Is the engine thread alive and moving? What ``/health`` and gRPC ``Health`` answer.

Both answer from threads other than the engine's, so without this a worker whose engine
thread died or hangs inside a step (a deadlock, a stuck collective, a wedged device)
kept answering "ok" and kept receiving traffic. The engine thread marks when it starts
work and when it goes back to waiting; a probe asks whether it is alive and, if it is
working, for how long. Idle waiting is never a stall: an idle worker is healthy.

One step is bounded by the scheduler's token budget (a 2,048-token prefill chunk of
SmolLM2 on one CPU core takes about 1 s), so a limit of a minute flags only a thread that
is stuck, not one that is slow; ``--engine-stall-timeout-s`` sets it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class EngineHeartbeat:
    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        assert stall_timeout_s > 0
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._busy_since_s: float | None = None  # None while the thread waits for work
        self._thread: threading.Thread | None = None
        self._checks: list[Callable[[], str | None]] = []

    def watch(self, thread: threading.Thread) -> None:
        self._thread = thread

    def also_check(self, check: Callable[[], str | None]) -> None:
        """Another reason the engine cannot serve (a tensor-parallel rank that exited)."""
        self._checks.append(check)

    # -- the engine thread ---------------------------------------------------------------

    def working(self) -> None:
        self._busy_since_s = self._clock()

    def waiting(self) -> None:
        self._busy_since_s = None

    # -- probes (any thread) -------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the engine cannot serve, or None when it can."""
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread has stopped"
        for check in self._checks:
            if (problem := check()) is not None:
                return problem
        since = self._busy_since_s
        if since is not None:
            busy_s = self._clock() - since
            if busy_s > self.stall_timeout_s:
                return (
                    f"the engine thread has been in one step for {busy_s:.0f} s "
                    f"(limit {self.stall_timeout_s:.0f} s: --engine-stall-timeout-s)"
                )
        return None
