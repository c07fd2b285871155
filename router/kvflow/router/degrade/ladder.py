"""The degradation ladder: which cheaper answers a model gives now (pure, clock passed in).

A model's ladder lists steps in the order to take them. While its SLO signals are hot (a
burn rate over ``engage_burn`` or queue time over ``engage_queue_s``) for ``engage_after_s``,
the next step is taken; while they are calm (every burn under ``release_burn`` and queue time
under ``release_queue_s``) for ``release_after_s``, the last step taken is reverted. Between
hot and calm the ladder holds: the two thresholds apart are the hysteresis that keeps it from
flapping, and one step per dwell lets each step show its effect before the next.

**Re-engaging backs the release off.** A step calms the very signals the ladder reads: with
tokens capped, queues drain and burns fall *because* of the cap, while the demand that made
them hot may go on. Calm signals alone cannot tell "the overload ended" from "the step
works", so a released step can be needed again a moment later, and each flap serves a dwell
of overload undegraded. The ladder learns from that as a circuit breaker does when it
re-opens: a step engaged again within ``reengage_window_s`` of its release doubles its next
release dwell (``release_after_s``, then twice, four times ..., never past
``max_release_after_s``); engaged after a longer calm, it starts from ``release_after_s``
again.

**A release waits for the demand to fall.** The back-off only learns from a flap; the
offered load (the window's arrivals per second, which no step changes) says beforehand
that the overload goes on. A step is released only once the offered load is under
``release_offered_ratio`` of what it was when the step was taken, or once the signals have
been calm for ``max_release_after_s`` whatever the load (capacity may have been added:
the load that was too much may fit now). A ladder fed no arrivals (offered 0) skips this.
Opt-in (``release_offered_ratio`` 0 by default): when it is capacity that comes back (a
worker recovered, the planner added replicas) while the requests keep coming as fast, the
hold would keep the steps for ``max_release_after_s``; the back-off alone costs a flap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from kvflow.router.degrade.signals import SloSignals


class Step(enum.StrEnum):
    """The steps the guides name, cheapest to the user first."""

    CAP_MAX_TOKENS = "cap_max_tokens"  # generate at most max_tokens_cap tokens
    DROP_EXTRAS = "drop_extras"  # no tools, structured output or logprobs
    FALLBACK_MODEL = "fallback_model"  # route to the model's smaller or quantized fallback
    RESPONSE_CACHE = "response_cache"  # answer from the response cache where one exists
    QUEUE_WITH_DEADLINE = "queue_with_deadline"  # wait for capacity up to a deadline, not fail


STEP_WORDS: tuple[str, ...] = tuple(s.value for s in Step)


@dataclass(frozen=True)
class LadderConfig:
    steps: tuple[Step, ...] = ()
    engage_burn: float = 2.0
    release_burn: float = 0.5
    engage_queue_s: float = 2.0
    release_queue_s: float = 0.5
    engage_after_s: float = 10.0
    release_after_s: float = 30.0
    min_requests: int = 5  # fewer requests in the window than this: signals are noise, hold
    # A step engaged again within this long of its release doubles its next release dwell
    # (0: never), up to max_release_after_s (never below release_after_s).
    reengage_window_s: float = 120.0
    max_release_after_s: float = 480.0
    # A step is released only once the offered load is under this share of what it was when
    # the step was taken (or after max_release_after_s calm); 0: the load is not asked.
    # Off by default: a planner that adds capacity must see the steps released promptly.
    release_offered_ratio: float = 0.0

    def __post_init__(self) -> None:
        if len(set(self.steps)) != len(self.steps):
            raise ValueError(f"a ladder lists each step once, got {[s.value for s in self.steps]}")
        if self.release_burn > self.engage_burn or self.release_queue_s > self.engage_queue_s:
            raise ValueError("release thresholds must not exceed engage thresholds (hysteresis)")
        if min(self.engage_after_s, self.release_after_s, self.reengage_window_s) < 0:
            raise ValueError("dwell times and reengage_window_s must be >= 0")
        if self.max_release_after_s < 0:
            raise ValueError("max_release_after_s must be >= 0")
        if self.release_offered_ratio < 0:
            raise ValueError("release_offered_ratio must be >= 0")

    @property
    def release_cap_s(self) -> float:
        """The longest release dwell backing off reaches."""
        return max(self.release_after_s, self.max_release_after_s)


@dataclass(frozen=True)
class Transition:
    at_s: float
    step: Step
    action: Literal["engaged", "released"]
    level: int  # steps active after this transition
    reason: str


@dataclass
class DegradationLadder:
    config: LadderConfig
    level: int = 0
    _hot_since_s: float | None = field(default=None, repr=False)
    _calm_since_s: float | None = field(default=None, repr=False)
    # Per step: when it was last released, and the calm it needs to be released next time.
    _released_at_s: dict[Step, float] = field(default_factory=dict, repr=False)
    _release_dwell_s: dict[Step, float] = field(default_factory=dict, repr=False)
    _engaged_offered_per_s: dict[Step, float] = field(default_factory=dict, repr=False)

    @property
    def active(self) -> tuple[Step, ...]:
        return self.config.steps[: self.level]

    def is_active(self, step: Step) -> bool:
        return step in self.active

    def release_dwell_s(self, step: Step) -> float:
        """How long the signals must stay calm before ``step`` is reverted."""
        return self._release_dwell_s.get(step, self.config.release_after_s)

    def _engage(self, now_s: float, step: Step, offered_per_s: float) -> None:
        cfg = self.config
        self._engaged_offered_per_s[step] = offered_per_s
        released_at = self._released_at_s.get(step)
        if released_at is not None and now_s - released_at <= cfg.reengage_window_s:
            # Needed again soon after its release: the release came too early.
            self._release_dwell_s[step] = min(cfg.release_cap_s, 2 * self.release_dwell_s(step))
        else:
            self._release_dwell_s[step] = cfg.release_after_s

    def observe(self, now_s: float, signals: SloSignals) -> Transition | None:
        """Feed the model's current signals; returns the step taken or reverted, if any."""
        cfg = self.config
        hot = signals.requests >= cfg.min_requests and (
            signals.ttft_burn > cfg.engage_burn
            or signals.tpot_burn > cfg.engage_burn
            or signals.queue_p90_s > cfg.engage_queue_s
        )
        calm = (
            signals.ttft_burn < cfg.release_burn
            and signals.tpot_burn < cfg.release_burn
            and signals.queue_p90_s < cfg.release_queue_s
        )
        if hot:
            self._calm_since_s = None
            self._hot_since_s = now_s if self._hot_since_s is None else self._hot_since_s
            if self.level < len(cfg.steps) and now_s - self._hot_since_s >= cfg.engage_after_s:
                self.level += 1
                self._engage(now_s, cfg.steps[self.level - 1], signals.offered_per_s)
                self._hot_since_s = now_s  # the next step waits a full dwell
                return Transition(
                    now_s, cfg.steps[self.level - 1], "engaged", self.level, _why(signals)
                )
            return None
        self._hot_since_s = None
        if not calm or self.level == 0:
            self._calm_since_s = None if not calm else self._calm_since_s
            return None
        self._calm_since_s = now_s if self._calm_since_s is None else self._calm_since_s
        step = cfg.steps[self.level - 1]
        calm_s = now_s - self._calm_since_s
        if calm_s >= self.release_dwell_s(step) and (
            calm_s >= cfg.release_cap_s or self._load_fell(step, signals)
        ):
            self.level -= 1
            self._released_at_s[cfg.steps[self.level]] = now_s
            self._calm_since_s = now_s
            return Transition(now_s, cfg.steps[self.level], "released", self.level, _why(signals))
        return None

    def _load_fell(self, step: Step, signals: SloSignals) -> bool:
        """Is the offered load under its share of what it was when ``step`` was taken?"""
        engaged = self._engaged_offered_per_s.get(step, 0.0)
        ratio = self.config.release_offered_ratio
        if ratio == 0 or engaged == 0 or signals.offered_per_s == 0:
            return True  # not asked, or no arrivals recorded
        return signals.offered_per_s < ratio * engaged


def _why(s: SloSignals) -> str:
    return (
        f"TTFT burn {s.ttft_burn:.2f}, TPOT burn {s.tpot_burn:.2f}, "
        f"queue P90 {s.queue_p90_s:.2f} s over {s.requests} requests, "
        f"offered {s.offered_per_s:.2f}/s"
    )
