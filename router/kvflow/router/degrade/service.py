"""Automatic degradation, the shell: each configured model's SLO window fed from its
requests, its ladder moved on a clock, and the active steps applied to each request.

The pure parts decide: degrade/signals.py (the window's burn rates and queue P90),
degrade/ladder.py (when to take or revert a step), degrade/request.py (what a step does to
a request). This module owns time and I/O: a background task looks at each model's window
every ``check_interval_s``, and each transition is counted
(``kvflow_router_degradation_transitions_total{model,step,action}``), shown in the level
gauge (``kvflow_router_degradation_level{model}``) and logged as one line (logger
``kvflow.router.degrade``) with the signals that moved it.

A request of a configured model gets a `RequestDegradation` (api/completions.py): the
request as the active steps changed it, the steps that changed it (the response's
``x-kvflow-degraded`` header), and the hooks that feed the window: its first-token and
per-token times when it finishes (api/accounting.py), or a refusal when the gateway turns
it away for want of capacity (a 503: no worker, queues full). Requests count against the
model they asked for, whatever served them: a fallback that answers fast is what calms the
ladder, which then reverts its steps one by one, each after a calm dwell.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvflow.proto.priority_class import PriorityClass
from kvflow.router.degrade.config import DegradationSpec, by_request_name
from kvflow.router.degrade.ladder import DegradationLadder, Step, Transition
from kvflow.router.degrade.request import (
    AnyRequest,
    cap_budget,
    cap_request,
    drop_extras,
    fall_back,
)
from kvflow.router.degrade.signals import SloWindow
from kvflow.router.protocol.errors import ApiError
from kvflow.router.serving.admission import Verdict
from kvflow.router.serving.admission_control import AdmissionControl
from kvflow.router.serving.token_budget import TokenBudget
from kvflow.router.tenants.config import Tenant

log = logging.getLogger("kvflow.router.degrade")

DEGRADED_HEADER = "x-kvflow-degraded"
ACTIONS = ("engaged", "released")
# What a refusal is for the window: the gateway had no capacity for the request.
_CAPACITY_STATUS = 503

Clock = Callable[[], float]


@dataclass
class ModelDegradation:
    """One model's ladder and the window it climbs on."""

    spec: DegradationSpec
    ladder: DegradationLadder
    window: SloWindow
    checked_s: float = float("-inf")


class DegradationMetrics:
    def __init__(self, registry: CollectorRegistry, specs: Sequence[DegradationSpec]) -> None:
        self.transitions = Counter(
            "kvflow_router_degradation_transitions_total",
            "Steps of a model's degradation ladder taken (engaged) or reverted (released)",
            ["model", "step", "action"],
            registry=registry,
        )
        self.level = Gauge(
            "kvflow_router_degradation_level",
            "Steps of the model's degradation ladder in force (0: none)",
            ["model"],
            registry=registry,
        )
        # Every series from the start, at 0: a dashboard can rate() them before any step.
        for spec in specs:
            self.level.labels(spec.model).set(0)
            for step in spec.ladder.steps:
                for action in ACTIONS:
                    self.transitions.labels(spec.model, step.value, action)


@dataclass
class RequestDegradation:
    """One request under its model's ladder (or none: every method is then a no-op)."""

    request: AnyRequest  # as the active steps changed it
    model: ModelDegradation | None = None
    active: tuple[Step, ...] = ()  # the steps in force when the request arrived
    applied: set[Step] = field(default_factory=set)  # the steps that changed it
    clock: Clock = time.monotonic
    queue_s: float = 0.0  # the admission's estimated wait, plus any wait for capacity here
    _asked_model: str = ""  # set when fallback_model replaced the request's model
    _is_recorded: bool = False

    @property
    def asked_model(self) -> str:
        """The model the client sent, before a fallback replaced it."""
        return self._asked_model or self.request.model

    @property
    def header(self) -> str | None:
        """The ``x-kvflow-degraded`` value: the steps that changed this request, in the
        ladder's order; None when none did."""
        if not self.applied:
            return None
        # A fallback taken for an open circuit is applied without being active.
        order = [*self.active, *(s for s in Step if s not in self.active)]
        return ",".join(s.value for s in order if s in self.applied)

    @property
    def serves_sampled(self) -> bool:
        """Under response_cache: a sampled request may get its greedy twin's stored answer
        (caches/policy.py)."""
        return Step.RESPONSE_CACHE in self.active

    def served_from_cache(self) -> None:
        """A sampled request got its greedy twin's stored answer: the step changed it."""
        self.applied.add(Step.RESPONSE_CACHE)

    def cap(self, budget: TokenBudget, prompt_lens: Sequence[int], n: int) -> TokenBudget:
        """The planned budget under cap_max_tokens (a left-out max_tokens' default too)."""
        if self.model is None or Step.CAP_MAX_TOKENS not in self.active:
            return budget
        cap = self.model.spec.max_tokens_cap
        assert cap is not None  # the config requires it with the step
        capped, changed = cap_budget(budget, prompt_lens, n, cap)
        if changed:
            self.applied.add(Step.CAP_MAX_TOKENS)
        return capped

    async def admit(
        self,
        admission: AdmissionControl,
        tenant: Tenant,
        model: str,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> Verdict:
        """Admission control's check; under queue_with_deadline a 503 (no capacity) is
        waited out, polling the workers' queues, for up to the model's deadline first."""
        waited_s = 0.0
        if self.model is not None and Step.QUEUE_WITH_DEADLINE in self.active:
            deadline_s = self.model.spec.queue_deadline_s
            assert deadline_s is not None  # the config requires it with the step
            waited_s = await _wait_for_capacity(
                admission, tenant, model, priority_class, deadline_s, self.clock
            )
            if waited_s > 0:
                self.applied.add(Step.QUEUE_WITH_DEADLINE)
        self.queue_s = waited_s
        try:
            verdict = admission.check(tenant, model, priority_class)
        except ApiError as exc:
            if waited_s > 0 and exc.status == _CAPACITY_STATUS:
                raise ApiError(exc.status, f"Waited {waited_s:.1f} s for capacity "
                               f"(queue_with_deadline), in vain. {exc.message}",
                               type=exc.type, code=exc.code,
                               retry_after_s=exc.retry_after_s) from exc  # fmt: skip
            raise
        self.queue_s += verdict.estimated_wait_s
        return verdict

    def refused(self, exc: BaseException) -> None:
        """The gateway refused the request before it ran: a 503 (no capacity) counts as a
        request that missed its first-token target; anything else (a bad request, a
        tenant's quota) says nothing of the model's capacity."""
        if isinstance(exc, ApiError) and exc.status == _CAPACITY_STATUS:
            self._record(None, None)

    def finished(
        self, ttft_s: float | None, tpot_s: float | None, *, left_after_s: float | None = None
    ) -> None:
        """The request ended; ``ttft_s`` None: no first token (it failed, or the client
        left first), which counts as late. ``left_after_s``: the client left, that long
        after it arrived. Before the model's TTFT target it says nothing of the model (a
        client that hangs up at once, by design or to push every tenant's requests down
        the ladder): not recorded."""
        model = self.model
        if (
            ttft_s is None
            and left_after_s is not None
            and model is not None
            and left_after_s < model.spec.targets.ttft_s
        ):
            return
        self._record(ttft_s, tpot_s)

    def _record(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if self.model is None or self._is_recorded:
            return
        self._is_recorded = True
        self.model.window.record(self.clock(), ttft_s, tpot_s, self.queue_s)


async def _wait_for_capacity(
    admission: AdmissionControl,
    tenant: Tenant,
    model: str,
    priority_class: PriorityClass,
    deadline_s: float,
    clock: Clock,
) -> float:
    """Seconds waited until admission control would admit (or refuse for another reason:
    a tenant over its share is not kept waiting), at most ``deadline_s``."""
    started_s = clock()
    has_waited = False
    while True:
        verdict = admission.peek(tenant, model, priority_class)
        remaining_s = started_s + deadline_s - clock()
        if verdict.status != _CAPACITY_STATUS or remaining_s <= 0:
            return clock() - started_s if has_waited else 0.0
        has_waited = True
        # The queues change when the workers next report: poll at the reports' pace.
        await asyncio.sleep(min(admission.config.poll_interval_s, remaining_s))


class Degradation:
    """Every configured model's ladder; ``specs`` empty: degradation is off."""

    def __init__(
        self,
        specs: Mapping[str, DegradationSpec],
        registry: CollectorRegistry | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._clock = clock
        self._models = {
            name: ModelDegradation(spec, DegradationLadder(spec.ladder),
                                   SloWindow(spec.targets, spec.window_s))
            for name, spec in specs.items()
        }  # fmt: skip
        self._by_name = {
            name: self._models[spec.model] for name, spec in by_request_name(specs).items()
        }
        self._metrics = (
            DegradationMetrics(registry, list(specs.values()))
            if registry is not None and specs
            else None
        )
        self._task: asyncio.Task[None] | None = None

    def level(self, model: str) -> int:
        return self._models[model].ladder.level

    def plan(
        self,
        request: AnyRequest,
        tenant: Tenant,
        is_refusing: Callable[[str], bool] = lambda model: False,
    ) -> RequestDegradation:
        """``request`` under its model's active steps. The fallback is taken only for a
        tenant allowed to use the fallback model (a degraded answer, never a forbidden one),
        and also, whatever the ladder's level, while every pool of the model refuses requests
        (``is_refusing``: circuit open or no healthy worker) and the fallback's do not."""
        state = self._by_name.get(request.model)
        if state is None:
            return RequestDegradation(request, clock=self._clock)
        # The offered load the ladder's release asks about: every request, whatever follows.
        state.window.record_arrival(self._clock())
        spec, active = state.spec, state.ladder.active
        plan = RequestDegradation(request, state, active, clock=self._clock)
        changed = False
        if Step.CAP_MAX_TOKENS in active:
            assert spec.max_tokens_cap is not None
            plan.request, changed = cap_request(plan.request, spec.max_tokens_cap)
            if changed:
                plan.applied.add(Step.CAP_MAX_TOKENS)
        if Step.DROP_EXTRAS in active:
            plan.request, changed = drop_extras(plan.request)
            if changed:
                plan.applied.add(Step.DROP_EXTRAS)
        fallback = spec.fallback_model
        wants_fallback = Step.FALLBACK_MODEL in active or (
            fallback is not None and is_refusing(request.model) and not is_refusing(fallback)
        )
        if wants_fallback and fallback is not None and tenant.may_use(fallback):
            plan._asked_model = request.model
            plan.request = fall_back(plan.request, fallback)
            plan.applied.add(Step.FALLBACK_MODEL)
        return plan

    def check(self, now_s: float | None = None) -> list[tuple[str, Transition]]:
        """Let each model's ladder look at its window, if its interval has passed."""
        now_s = self._clock() if now_s is None else now_s
        moved = []
        for name, state in self._models.items():
            # A tick a hair early (the sleep's rounding) still counts.
            if now_s - state.checked_s < state.spec.check_interval_s * 0.99:
                continue
            state.checked_s = now_s
            transition = state.ladder.observe(now_s, state.window.signals(now_s))
            if transition is not None:
                self._report(name, transition)
                moved.append((name, transition))
        return moved

    def _report(self, model: str, t: Transition) -> None:
        if self._metrics is not None:
            self._metrics.transitions.labels(model, t.step.value, t.action).inc()
            self._metrics.level.labels(model).set(t.level)
        # Taking a step changes answers: a warning; reverting one is back to normal.
        log.log(
            logging.WARNING if t.action == "engaged" else logging.INFO,
            'degradation model=%s step=%s action=%s level=%d reason="%s"',
            _logfmt(model), t.step.value, t.action, t.level, t.reason,
        )  # fmt: skip

    def start(self) -> None:
        if self._models and self._task is None:
            self._task = asyncio.create_task(self._run(), name="degradation-ladders")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        interval_s = min(s.spec.check_interval_s for s in self._models.values())
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.check()
            except Exception:  # a bug here must not stop the ladders for good
                log.exception("degradation check failed")


def _logfmt(value: str) -> str:
    if value and all(c.isalnum() or c in "-_.:/@" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
