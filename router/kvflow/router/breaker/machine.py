"""One circuit breaker, as a state machine on the time its caller passes in.

closed -> open: in the last ``window_s`` at least ``min_requests`` requests ended with a
verdict and at least ``failure_rate`` of them failed (an error, a timeout, a stall); or one
request stalled (missed a first-token or token-stall deadline, workers/deadlines.py): a
stall cost its client a whole deadline, tens of seconds, so waiting for ``min_requests``
of them would cost that many deadlines.
open -> half-open: ``open_s`` after opening, doubled for each re-open in a row, at most
``max_open_s``. Nothing is sent meanwhile.
half-open: at most ``half_open_probes`` requests go through (probes). When that many have
succeeded the circuit closes and the doubling starts over; one failure opens it again.

A request takes a `Ticket` when it is sent and gives its verdict with it. Verdicts from
before the circuit last changed state are ignored (the ticket's epoch is stale): a slow
failure from before a re-close must not count in the fresh window, nor a success sent
before the circuit opened close a half-open circuit.

Reading (`state`, `admits`, `open_remaining_s`, `counts`) never changes anything, so a
metrics scrape on another thread may read; the open -> half-open step is taken by the next
`start`, `finish` or `abandon`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.router.breaker.window import SlidingWindow, WindowCounts

# A failure rate over 30 s, judged from 10 requests: one slow or failed request in a quiet
# minute does not open a worker's circuit, a worker failing every other request does within
# 10 of them (a few seconds of traffic). 10 s open covers a passing stall; doubling to 5
# minutes, a worker broken for good costs one probe per 5 minutes (a wedged one's probe
# waits a whole first-token deadline). 2 probes: one lucky request does not close it.
DEFAULT_FAILURE_RATE = 0.5
DEFAULT_WINDOW_S = 30.0
DEFAULT_MIN_REQUESTS = 10
DEFAULT_OPEN_S = 10.0
DEFAULT_MAX_OPEN_S = 300.0
DEFAULT_HALF_OPEN_PROBES = 2


class CircuitState(enum.IntEnum):
    """The values are the metrics' gauge values."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Outcome(enum.Enum):
    """A request's verdict on where it ran. A request that ended without one (the client
    left, the worker refused it as invalid or was full) is `abandon`ed instead."""

    SUCCESS = "success"
    ERROR = "error"  # the worker failed it: down, broken, a stream cut short
    TIMEOUT = "timeout"  # no answer within a call's deadline
    STALL = "stall"  # a stream missed its first-token or token-stall deadline

    @property
    def is_failure(self) -> bool:
        return self is not Outcome.SUCCESS


class BreakerConfigError(ValueError):
    """A breaker setting out of range; the message names its flag."""


@dataclass(frozen=True)
class BreakerConfig:
    """The --breaker-* flags (docs/router.md, "Circuit breaker")."""

    is_enabled: bool = True
    failure_rate: float = DEFAULT_FAILURE_RATE  # --breaker-error-rate, a fraction 0..1
    window_s: float = DEFAULT_WINDOW_S
    min_requests: int = DEFAULT_MIN_REQUESTS
    open_s: float = DEFAULT_OPEN_S
    max_open_s: float = DEFAULT_MAX_OPEN_S
    half_open_probes: int = DEFAULT_HALF_OPEN_PROBES

    def __post_init__(self) -> None:
        if not 0 < self.failure_rate <= 1:
            raise BreakerConfigError(
                f"--breaker-error-rate must be a fraction in (0, 1], got {self.failure_rate}"
            )
        for flag, value in (("--breaker-window-s", self.window_s),
                            ("--breaker-open-s", self.open_s)):  # fmt: skip
            if not value > 0:
                raise BreakerConfigError(f"{flag} must be > 0, got {value}")
        if self.max_open_s < self.open_s:
            raise BreakerConfigError(
                f"--breaker-max-open-s ({self.max_open_s}) must be at least --breaker-open-s "
                f"({self.open_s})"
            )
        for flag, number in (("--breaker-min-requests", self.min_requests),
                             ("--breaker-half-open-probes", self.half_open_probes)):  # fmt: skip
            if number < 1:
                raise BreakerConfigError(f"{flag} must be an integer >= 1, got {number}")

    def open_time_s(self, num_opens_in_a_row: int) -> float:
        """How long the ``num_opens_in_a_row``-th opening in a row lasts."""
        assert num_opens_in_a_row >= 1
        doublings = min(num_opens_in_a_row - 1, 32)  # 2**32 x open_s is past any cap
        return min(self.open_s * 2.0**doublings, self.max_open_s)


@dataclass(frozen=True)
class Ticket:
    """A request sent through a breaker: the epoch it was sent in, and whether it is one of
    a half-open circuit's probes."""

    epoch: int
    is_probe: bool


# (from, to): for the transitions counter and the log.
TransitionHook = Callable[[CircuitState, CircuitState], None]


class Breaker:
    def __init__(self, config: BreakerConfig, on_transition: TransitionHook | None = None) -> None:
        self.config = config
        self._on_transition = on_transition
        self._state = CircuitState.CLOSED
        self._epoch = 0  # +1 at each transition
        self._open_until_s = 0.0
        self._num_opens = 0  # opens since the circuit last closed (the backoff's exponent)
        self._window = SlidingWindow(config.window_s)
        self._num_probes = 0  # half-open: probes sent and not abandoned
        self._num_probe_successes = 0
        self.last_trip = ""  # why it last opened, for messages

    # -- reading -------------------------------------------------------------------------

    def state(self, now_s: float) -> CircuitState:
        if self._state is CircuitState.OPEN and now_s >= self._open_until_s:
            return CircuitState.HALF_OPEN
        return self._state

    def admits(self, now_s: float) -> bool:
        """Whether a request may be sent now: closed, or half-open with a probe to spare."""
        state = self.state(now_s)
        if state is CircuitState.HALF_OPEN:
            is_fresh = self._state is CircuitState.OPEN  # (its probes not counted yet)
            return is_fresh or self._num_probes < self.config.half_open_probes
        return state is CircuitState.CLOSED

    def open_remaining_s(self, now_s: float) -> float:
        """Until the circuit goes half-open; 0 unless open."""
        if self.state(now_s) is not CircuitState.OPEN:
            return 0.0
        return self._open_until_s - now_s

    def counts(self, now_s: float) -> WindowCounts:
        return self._window.counts(now_s)

    # -- requests ------------------------------------------------------------------------

    def start(self, now_s: float) -> Ticket:
        """A request is being sent (the caller checked `admits`)."""
        self._settle(now_s)
        is_probe = self._state is CircuitState.HALF_OPEN
        if is_probe:
            self._num_probes += 1
        return Ticket(self._epoch, is_probe)

    def finish(self, ticket: Ticket, outcome: Outcome, now_s: float) -> None:
        """The verdict of the request sent with ``ticket``."""
        self._settle(now_s)
        if not self.config.is_enabled or ticket.epoch != self._epoch:
            return
        if self._state is CircuitState.CLOSED:
            self._window.add(now_s, is_failure=outcome.is_failure)
            counts = self._window.counts(now_s)
            if outcome is Outcome.STALL:
                self._open(now_s, "a request stalled (missed its deadline)")
            elif (counts.num_requests >= self.config.min_requests
                  and counts.failure_rate >= self.config.failure_rate):  # fmt: skip
                self._open(now_s, f"{counts.num_failures} of {counts.num_requests} requests "
                                  f"failed in the last {self.config.window_s:g} s")  # fmt: skip
        elif self._state is CircuitState.HALF_OPEN and ticket.is_probe:
            if outcome.is_failure:
                self._open(now_s, f"a half-open probe failed ({outcome.value})")
            else:
                self._num_probe_successes += 1
                if self._num_probe_successes >= self.config.half_open_probes:
                    self._num_opens = 0
                    self._window.clear()
                    self._transition(CircuitState.CLOSED)

    def abandon(self, ticket: Ticket, now_s: float) -> None:
        """The request sent with ``ticket`` ended without a verdict: its probe is free."""
        self._settle(now_s)
        if ticket.epoch == self._epoch and ticket.is_probe and self._num_probes > 0:
            self._num_probes -= 1

    # -- transitions ---------------------------------------------------------------------

    def _settle(self, now_s: float) -> None:
        if self._state is CircuitState.OPEN and now_s >= self._open_until_s:
            self._num_probes = self._num_probe_successes = 0
            self._transition(CircuitState.HALF_OPEN)

    def _open(self, now_s: float, why: str) -> None:
        self._num_opens += 1
        self._open_until_s = now_s + self.config.open_time_s(self._num_opens)
        self.last_trip = why
        self._transition(CircuitState.OPEN)

    def _transition(self, to: CircuitState) -> None:
        was = self._state
        self._state = to
        self._epoch += 1
        if self._on_transition is not None:
            self._on_transition(was, to)
