"""A request's CPU work before generation, off the event loop and under a time limit.

Rendering the chat template, tokenizing and compiling a schema or grammar take time that
grows with what the caller sent; on the event loop, one large request stalls every other
request and /health with it. So they run on a few threads (``PreparePool``):

- **bounded**: at most ``threads`` run and ``max_waiting`` wait; past that the gateway is
  busy preparing and says 503 with Retry-After (nothing was spent on the request).
- **timed**: a request's work has ``timeout_s`` from when it was queued. Past it while
  still queued: 503 (the gateway was busy, a retry may pass); past it while running: 400
  naming the limit (the request itself is too costly: a retry would be too). A thread
  cannot be stopped from outside, so the work bounds itself: templates check the deadline
  (text/chat_template.py), grammars compile under llguidance's limits
  (structured/constraint.py), and tokenizing is bounded by the body size.

Tokenizers and llguidance release the GIL for most of their work (the loop waited at
most 20-40 ms while 2.4 MB of text tokenized or a 3.5 MB regex compiled for 3.5 s), and
the interpreter hands it back every few milliseconds otherwise: the loop stays responsive.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvflow.proto.stack import LargeStackThreadPool
from kvflow.router.protocol.errors import ApiError, no_worker_available
from kvflow.router.text.chat_template import RenderTimeoutError, render_deadline

T = TypeVar("T")

# Two threads per core of a typical gateway pod is enough: the work mostly runs without
# the GIL, and more threads only queue for it.
DEFAULT_PREPARE_THREADS = 4
DEFAULT_PREPARE_MAX_WAITING = 256
# Far past any honest request (a 128k-token prompt tokenizes in about 0.1 s, a large
# schema compiles in tens of ms), near enough that a hostile one cannot hold a thread long.
DEFAULT_PREPARE_TIMEOUT_S = 10.0

PREPARE_FLAGS = {
    "threads": "--prepare-threads",
    "max_waiting": "--prepare-max-waiting",
    "timeout_s": "--prepare-timeout-s",
}


@dataclass(frozen=True)
class PrepareConfig:
    threads: int = DEFAULT_PREPARE_THREADS
    max_waiting: int = DEFAULT_PREPARE_MAX_WAITING
    timeout_s: float = DEFAULT_PREPARE_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"{PREPARE_FLAGS['threads']} must be an integer >= 1")
        if (
            isinstance(self.max_waiting, bool)
            or not isinstance(self.max_waiting, int)
            or self.max_waiting < 0
        ):
            raise ValueError(f"{PREPARE_FLAGS['max_waiting']} must be an integer >= 0")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"{PREPARE_FLAGS['timeout_s']} must be a number of seconds > 0")


def prepare_timed_out(timeout_s: float) -> ApiError:
    return ApiError(
        400,
        f"Preparing this request (chat template, tokenizer, grammar compiler) took longer "
        f"than this gateway's limit, prepare_timeout_s = {timeout_s:g} s "
        f"({PREPARE_FLAGS['timeout_s']}); send smaller messages, prompts or schemas.",
        code="request_too_costly",
    )


def prepare_busy(message: str) -> ApiError:
    return no_worker_available(message, retry_after_s=1.0)


class _QueuedTooLongError(Exception):
    """The work's deadline passed before a thread picked it up."""


class PreparePool:
    """Runs a request's preparation on a bounded set of threads with a deadline."""

    def __init__(
        self,
        config: PrepareConfig | None = None,
        on_refusal: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.config = config or PrepareConfig()
        # Told "busy" (no thread free, or none within the time limit) or "timeout" (the
        # work itself ran past it): kvflow_router_prepare_refusals_total.
        self._on_refusal = on_refusal
        # A large stack: compiling a schema or grammar recurses per reference in native
        # code, and overflowed the default one (proto/stack.py).
        self._executor = LargeStackThreadPool(
            max_workers=self.config.threads, thread_name_prefix="kvflow-prepare"
        )
        # Running or waiting, counted until the thread is done (not when the caller stops
        # waiting: a timed-out render still holds its thread for a moment).
        self.num_pending = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        # Waiting work is dropped; running work ends within its own deadline.
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, work: Callable[[], T]) -> T:
        """``work()`` on a prepare thread; raises its ApiError, or the 503 (busy, queued
        too long) or 400 (ran too long) above."""
        config = self.config
        if self.num_pending >= config.threads + config.max_waiting:
            self._on_refusal("busy")
            raise prepare_busy(
                f"The gateway is busy preparing other requests ({self.num_pending} queued or "
                f"running; prepare_threads = {config.threads}, prepare_max_waiting = "
                f"{config.max_waiting}); retry shortly."
            )
        deadline_s = time.monotonic() + config.timeout_s

        def timed() -> T:
            if time.monotonic() > deadline_s:
                raise _QueuedTooLongError
            with render_deadline(deadline_s):
                return work()

        with self._lock:
            self.num_pending += 1
        future = self._executor.submit(timed)
        future.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), config.timeout_s)
        except TimeoutError:
            if future.cancel():  # never started: the gateway was the slow part
                raise self._queued_too_long() from None
            raise self._timed_out() from None
        except _QueuedTooLongError:
            raise self._queued_too_long() from None
        except RenderTimeoutError:
            raise self._timed_out() from None

    def _done(self, _: object) -> None:
        with self._lock:
            self.num_pending -= 1

    def _timed_out(self) -> ApiError:
        self._on_refusal("timeout")
        return prepare_timed_out(self.config.timeout_s)

    def _queued_too_long(self) -> ApiError:
        self._on_refusal("busy")
        return prepare_busy(
            f"The gateway was too busy to prepare this request within prepare_timeout_s = "
            f"{self.config.timeout_s:g} s ({PREPARE_FLAGS['timeout_s']}); retry shortly."
        )
