"""The gateway's side of the overload scenario: class-ordered shedding and the degradation
ladder, pure (the clock is passed in).

**Admission by class.** The router's admission core (``kvflow.router.serving.admission``)
estimates how long a new request would wait for a worker, from the queues the workers
report. Here each class has its own bound on that wait, ascending in ``SHED_ORDER``: as
the queues grow, batch is refused (503) first, then normal, and realtime last. The off and
on arms both shed this way; the ladder is what differs.

**The ladder.** One ``DegradationLadder`` for the model, fed every ``evaluate_interval_s``
by a ``SloWindow`` of the requests that ended (and were refused) in the last ``window_s``.
The classes have different targets, so each sample is its latency divided by its own
class's target and the window's targets are 1.0: the window's burn rate is then the share
of requests late *for their class*. Its steps, as the gateway applies them:

- ``cap_max_tokens``: a request that arrives while it is active generates at most
  ``max_tokens_cap`` tokens (the batch tenant's 1,024 become 256; the others ask less);
- ``drop_extras``: no tools, structured output or logprobs. The simulated requests carry
  none and the step model does not price them: in the simulator it changes nothing,
  and is on the ladder so its place in the order (and its dwell) is the gateway's;
- ``queue_with_deadline``: a request that admission would refuse waits at the gateway
  instead, up to ``hold_share_of_ttft`` of its class's TTFT target, and is sent as soon
  as admission lets its class in (most urgent class first, then first come); past the
  deadline it is refused as before.

``fallback_model`` and ``response_cache`` are left out: the scenario models one pool and
no cache of responses.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvflow.proto.priority_class import SHED_ORDER, PriorityClass
from kvflow.router.degrade.config import DEFAULT_WINDOW_S as GATEWAY_WINDOW_S
from kvflow.router.degrade.ladder import DegradationLadder, LadderConfig, Step, Transition
from kvflow.router.degrade.signals import SloSignals, SloTargets, SloWindow
from kvflow.router.serving.admission import AdmissionConfig, TenantLoad, WorkerQueue, decide
from kvflow.sim.overload_traffic import ClassSlo

# Admission's over-share rule is per tenant; the class bounds replace it here (one tenant as
# admission sees it: never over a share).
_ONE_TENANT = TenantLoad(0, 1.0, 0, 1.0, 1)

# The wait each class tolerates before it is refused: batch first (SHED_ORDER), realtime at
# the router's own default bound (--admission-max-queue-time-s, 30 s).
DEFAULT_SHED_WAIT_S: Mapping[PriorityClass, float] = {
    PriorityClass.BATCH: 2.0,
    PriorityClass.NORMAL: 6.0,
    PriorityClass.REALTIME: 30.0,
}
DEFAULT_STEPS: tuple[Step, ...] = (Step.CAP_MAX_TOKENS, Step.DROP_EXTRAS, Step.QUEUE_WITH_DEADLINE)
# The gateway's defaults (router degrade/config.py): its thresholds, dwells, re-engage
# back-off and window, so what the scenario shows is what a gateway does unconfigured.
DEFAULT_LADDER = LadderConfig(DEFAULT_STEPS)
DEFAULT_WINDOW_S = GATEWAY_WINDOW_S
# The window's targets: a sample is latency / its class's target, so 1.0 is "on target".
_NORMALIZED = SloTargets(ttft_s=1.0, tpot_s=1.0, percentile=90.0)


class Decision(enum.Enum):
    ADMIT = "admit"
    SHED = "shed"  # 503 now
    HOLD = "hold"  # queue_with_deadline: wait at the gateway


@dataclass(frozen=True)
class GatewayConfig:
    shed_wait_s: Mapping[PriorityClass, float] = field(
        default_factory=lambda: dict(DEFAULT_SHED_WAIT_S)
    )
    # None: degradation off (the ladder never climbs).
    ladder: LadderConfig | None = field(default_factory=lambda: DEFAULT_LADDER)
    max_tokens_cap: int = 256
    hold_share_of_ttft: float = 0.5
    window_s: float = DEFAULT_WINDOW_S
    evaluate_interval_s: float = 1.0

    def __post_init__(self) -> None:
        bounds = [self.shed_wait_s[c] for c in SHED_ORDER]  # KeyError names a missing class
        if any(b <= 0 for b in bounds) or bounds != sorted(bounds):
            raise ValueError(
                "each class's shed wait must be > 0 and rise in the shed order "
                f"({', '.join(c.value for c in SHED_ORDER)}), got {bounds}"
            )
        if self.max_tokens_cap < 1:
            raise ValueError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if not 0 < self.hold_share_of_ttft <= 1:
            raise ValueError(f"hold_share_of_ttft must be in (0, 1], got {self.hold_share_of_ttft}")
        if self.window_s <= 0 or self.evaluate_interval_s <= 0:
            raise ValueError("window_s and evaluate_interval_s must be > 0")

    @property
    def is_degrading(self) -> bool:
        return self.ladder is not None and bool(self.ladder.steps)


@dataclass(frozen=True)
class LevelSample:
    at_s: float
    level: int
    signals: SloSignals


class OverloadGateway:
    def __init__(self, config: GatewayConfig, slos: Mapping[PriorityClass, ClassSlo]) -> None:
        self.config = config
        self.slos = dict(slos)
        self.window = SloWindow(_NORMALIZED, config.window_s)
        self.ladder = DegradationLadder(config.ladder or LadderConfig())
        self.transitions: list[Transition] = []
        self.levels: list[LevelSample] = []
        self._admission = {
            c: AdmissionConfig(shed_queue_time_s=s, max_queue_time_s=s)
            for c, s in config.shed_wait_s.items()
        }

    def is_active(self, step: Step) -> bool:
        return self.ladder.is_active(step)

    def decide(
        self,
        priority_class: PriorityClass,
        queues: Sequence[WorkerQueue],
        num_opened_since_report: int,
    ) -> Decision:
        """Admit, refuse, or (queue_with_deadline active) hold a request of this class."""
        verdict = decide(queues, num_opened_since_report, _ONE_TENANT,
                         self._admission[priority_class])  # fmt: skip
        if verdict.is_admitted:
            return Decision.ADMIT
        return Decision.HOLD if self.is_active(Step.QUEUE_WITH_DEADLINE) else Decision.SHED

    def hold_deadline_s(self, priority_class: PriorityClass, arrived_s: float) -> float:
        return arrived_s + self.config.hold_share_of_ttft * self.slos[priority_class].ttft_s

    def max_tokens(self, requested: int) -> int:
        """The max tokens a request arriving now generates."""
        if self.is_active(Step.CAP_MAX_TOKENS):
            return min(requested, self.config.max_tokens_cap)
        return requested

    def record_served(
        self,
        now_s: float,
        priority_class: PriorityClass,
        ttft_s: float | None,
        tpot_s: float | None,
        queue_s: float,
    ) -> None:
        slo = self.slos[priority_class]
        self.window.record(
            now_s,
            None if ttft_s is None else ttft_s / slo.ttft_s,
            None if tpot_s is None else tpot_s / slo.tpot_s,
            queue_s,
        )

    def record_arrival(self, now_s: float) -> None:
        self.window.record_arrival(now_s)

    def record_refused(self, now_s: float, queue_s: float = 0.0) -> None:
        self.window.record(now_s, None, None, queue_s)

    def evaluate(self, now_s: float) -> Transition | None:
        """The ladder's periodic look at the window (a no-op ladder when degradation is off)."""
        signals = self.window.signals(now_s)
        transition = self.ladder.observe(now_s, signals) if self.config.is_degrading else None
        if transition is not None:
            self.transitions.append(transition)
        self.levels.append(LevelSample(now_s, self.ladder.level, signals))
        return transition
