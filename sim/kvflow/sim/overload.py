"""The overload scenario: a pool offered twice what it can serve, three tenants in three
priority classes, degradation off and on side by side (docs/simulator.md, "Overload and the
degradation ladder").

1. **Capacity.** The pool's saturation throughput on the traffic mix: a burst of requests
   drawn from the mix, all sent at once with nothing refused, and the rate at which the
   middle 80 % of them finish (the ends are the pool filling and draining).
2. **Arrivals.** One open-loop list for the phases (``overload_traffic``), in multiples of
   that capacity; every arm gets the same list, and the same seed for its routing.
3. **Arms.** The same pool and gateway, once with the degradation ladder off and once with
   it on (``overload_gateway``). Each request's life: arrival at the gateway -> admit,
   refuse (503) or hold -> the router's placement -> the simulated worker, which keys its
   fair share on the tenant and carries the request's priority class.

Each arm's outcome: one record per request with its class, when it arrived at the gateway
(TTFT counts any time held there), whether it was capped, held or refused; the ladder's
transitions and level over time.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest
from kvflow.proto.priority_class import PriorityClass
from kvflow.router.degrade.ladder import Transition
from kvflow.sim.arms import Arm, resolve_arm
from kvflow.sim.cluster import ClusterSpec, VirtualCluster, _InFlight
from kvflow.sim.overload_gateway import Decision, GatewayConfig, LevelSample, OverloadGateway
from kvflow.sim.overload_traffic import (
    DEFAULT_MIX,
    DEFAULT_PHASES,
    DEFAULT_SCENARIO,
    Arrival,
    LoadPhase,
    TenantTraffic,
    arrivals,
    check_mix,
    mix_request,
)

# How often the gateway looks at its held requests (its admission's poll interval).
GATEWAY_TICK_S = 0.1
ARM_NAMES = ("off", "on")


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it; ``record`` times are from its gateway arrival."""

    traffic: TenantTraffic
    record: RequestRecord
    is_capped: bool = False
    held_s: float = 0.0
    is_shed: bool = False

    @property
    def priority_class(self) -> PriorityClass:
        return self.traffic.priority_class

    @property
    def meets_slo(self) -> bool:
        return self.record.is_ok and self.traffic.slo.is_met(self.record.ttft_s,
                                                             self.record.tpot_s)  # fmt: skip


@dataclass
class _Pending:
    arrival: Arrival
    max_tokens: int
    is_capped: bool
    deadline_s: float | None = None  # held: refused past this


class OverloadCluster(VirtualCluster):
    """A fixed pool behind the overload gateway. Uses one thing of its base class that it
    does not publish: ``_num_pending`` (a held request is still pending: the router keeps
    polling until it is sent or refused)."""

    def __init__(self, spec: ClusterSpec, arm: Arm, gateway: OverloadGateway, *, seed: int = 0):
        if spec.admission is not None:
            raise ValueError("the overload gateway does its own admission: leave spec's off")
        super().__init__(spec, arm, seed=seed)
        self.gateway = gateway
        self._arrivals: dict[str, Arrival] = {}
        self._pending: dict[str, _Pending] = {}
        self._held: list[str] = []  # arrival order
        self._sent_s: dict[str, float] = {}
        self._flags: dict[str, tuple[bool, float, bool]] = {}  # capped, held_s, shed
        self._is_ticking = False
        self._next_evaluate_s = 0.0

    def offer(self, arrival: Arrival) -> None:
        self._arrivals[arrival.request.request_id] = arrival
        self.submit(arrival.request, arrival.at_s)
        if not self._is_ticking:
            self._is_ticking = True
            self.events.at(0.0, self._tick)

    def outcomes(self) -> list[Outcome]:
        out = []
        for sent in self.run():
            arrival = self._arrivals[sent.request_id]
            capped, held_s, shed = self._flags.get(sent.request_id, (False, 0.0, False))
            at_s = arrival.at_s  # TTFT and the rest from the gateway's arrival, hold included
            record = dataclasses.replace(sent, scheduled_s=at_s, sent_s=at_s)
            out.append(Outcome(arrival.traffic, record, capped, held_s, shed))
        return sorted(out, key=lambda o: (o.record.sent_s, o.record.request_id))

    # -- the gateway ---------------------------------------------------------------------

    def _tenant_and_class(self, request: BenchRequest) -> tuple[str | None, PriorityClass]:
        traffic = self._arrivals[request.request_id].traffic
        return traffic.tenant, traffic.priority_class

    def _arrive(self, request: BenchRequest) -> None:
        now_s = self.events.now_s
        arrival = self._arrivals[request.request_id]
        self.gateway.record_arrival(now_s)
        max_tokens = self.gateway.max_tokens(request.num_output_tokens)
        pending = _Pending(arrival, max_tokens, max_tokens < request.num_output_tokens)
        decision = self._decide(arrival.traffic.priority_class)
        if decision is Decision.ADMIT:
            self._send(pending)
        elif decision is Decision.HOLD:
            pending.deadline_s = self.gateway.hold_deadline_s(arrival.traffic.priority_class,
                                                              now_s)  # fmt: skip
            self._pending[request.request_id] = pending
            self._held.append(request.request_id)
        else:
            self._shed(pending, now_s)

    def _decide(self, priority_class: PriorityClass) -> Decision:
        found = self.router.book.queues(self.spec.model, 0.0)
        return self.gateway.decide(priority_class, found.queues, found.num_opened_since_report)

    def _send(self, pending: _Pending) -> None:
        request = pending.arrival.request
        request_id = request.request_id
        self._pending.pop(request_id, None)
        held_s = self.events.now_s - pending.arrival.at_s
        self._flags[request_id] = (pending.is_capped, held_s, False)
        self._sent_s[request_id] = self.events.now_s
        if pending.is_capped:
            request = dataclasses.replace(request, num_output_tokens=pending.max_tokens)
        super()._arrive(request)  # placement and the worker, as the base cluster does

    def _shed(self, pending: _Pending, now_s: float) -> None:
        request_id = pending.arrival.request.request_id
        self._pending.pop(request_id, None)
        self._num_pending -= 1
        held_s = now_s - pending.arrival.at_s
        self._flags[request_id] = (pending.is_capped, held_s, True)
        reason = "deadline" if pending.deadline_s is not None else "class_shed"
        self._fail(pending.arrival.request, now_s, "http_503",
                   f"{reason}: {pending.arrival.traffic.priority_class.value}")  # fmt: skip
        self.gateway.record_refused(now_s, held_s)

    def _tick(self) -> None:
        now_s = self.events.now_s
        if self._held:
            self._release_held(now_s)
        if now_s >= self._next_evaluate_s:
            self.gateway.evaluate(now_s)
            self._next_evaluate_s = now_s + self.gateway.config.evaluate_interval_s
        if self._num_pending or self._inflight:
            self.events.after(GATEWAY_TICK_S, self._tick)
        else:
            self._is_ticking = False

    def _release_held(self, now_s: float) -> None:
        """Send what admission now lets in, most urgent class first; refuse the expired."""
        order = sorted(self._held, key=lambda r: (
            self._pending[r].arrival.traffic.priority_class.rank, self._pending[r].arrival.at_s
        ))  # fmt: skip
        blocked: set[PriorityClass] = set()
        for request_id in order:
            pending = self._pending[request_id]
            klass = pending.arrival.traffic.priority_class
            if klass not in blocked and self._decide(klass) is Decision.ADMIT:
                self._send(pending)
            elif pending.deadline_s is not None and now_s >= pending.deadline_s:
                self._shed(pending, now_s)
            else:
                blocked.add(klass)  # first come first served within a class
        self._held = [r for r in self._held if r in self._pending]

    # -- what the window learns ----------------------------------------------------------

    def _finish(self, flight: _InFlight, out: RequestOutput, now_s: float) -> None:
        super()._finish(flight, out, now_s)
        record = self.records[-1]
        arrival = self._arrivals[record.request_id]
        ttft_s = record.token_times_s[0] - arrival.at_s if record.token_times_s else None
        held_s = self._sent_s[record.request_id] - arrival.at_s
        queued_s = out.timings.queued_s if out.timings is not None else 0.0
        self.gateway.record_served(now_s, arrival.traffic.priority_class, ttft_s, record.tpot_s,
                                   held_s + queued_s)  # fmt: skip


# -- capacity -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float
    num_requests: int
    middle_s: float  # the middle 80 %'s span

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def measure_capacity(
    spec: ClusterSpec, mix: Sequence[TenantTraffic], *, num_requests: int, seed: int
) -> Capacity:
    """The pool's saturation throughput on the mix: ``num_requests`` at t = 0, none refused,
    one tenant (first come first served), the rate of the middle 80 % of their ends. Placed
    round-robin: at t = 0 no worker has reported a load, and a load-aware placement would
    pile the burst onto one worker (measuring one worker, not the pool)."""
    check_mix(mix)
    cluster = VirtualCluster(spec, resolve_arm("round-robin"), seed=seed)
    rng = random.Random(f"{seed}/overload-capacity")
    for i in range(num_requests):
        request, _ = mix_request(mix, i, rng, seed=seed, namespace="capacity")
        cluster.submit(request, 0.0)
    ends = sorted(r.end_s for r in cluster.run() if r.is_ok)
    if len(ends) < 10:
        raise ValueError(f"the capacity burst needs >= 10 requests, got {len(ends)}")
    lo, hi = ends[len(ends) // 10], ends[(9 * len(ends)) // 10]
    span_s = max(hi - lo, 1e-9)
    return Capacity(((9 * len(ends)) // 10 - len(ends) // 10) / span_s, num_requests, span_s)


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverloadConfig:
    profile: SimProfile
    num_workers: int = 2
    routing_arm: str = "kvflow"
    mix: tuple[TenantTraffic, ...] = DEFAULT_MIX
    scenario: str = DEFAULT_SCENARIO  # the mix's name ("custom": given as --mix)
    phases: tuple[LoadPhase, ...] = DEFAULT_PHASES
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    capacity_requests: int = 600
    capacity_per_s: float | None = None  # None: measured
    seed: int = 0

    def spec(self) -> ClusterSpec:
        return ClusterSpec(self.profile, num_workers=self.num_workers)

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)


@dataclass
class ArmResult:
    name: str  # "off" or "on"
    outcomes: list[Outcome]
    transitions: list[Transition]
    levels: list[LevelSample]
    wall_s: float


@dataclass
class OverloadResult:
    config: OverloadConfig
    capacity: Capacity | None  # None: given, not measured
    capacity_per_s: float
    num_arrivals: int
    arms: list[ArmResult] = field(default_factory=list)

    def arm(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.name == name)

    def num_in_window(self, lo_s: float, hi_s: float) -> int:
        """The requests that arrived in [lo_s, hi_s) (the same in every arm)."""
        if not self.arms:
            return 0
        return sum(1 for o in self.arms[0].outcomes if lo_s <= o.record.sent_s < hi_s)


def run_arm(config: OverloadConfig, name: str, schedule: Sequence[Arrival]) -> ArmResult:
    gateway_config = config.gateway
    if name == "off":
        gateway_config = dataclasses.replace(gateway_config, ladder=None)
    slos = {t.priority_class: t.slo for t in config.mix}
    gateway = OverloadGateway(gateway_config, slos)
    started_s = time.perf_counter()
    cluster = OverloadCluster(config.spec(), resolve_arm(config.routing_arm), gateway,
                              seed=config.seed)  # fmt: skip
    for arrival in schedule:
        cluster.offer(arrival)
    outcomes = cluster.outcomes()
    return ArmResult(name, outcomes, list(gateway.transitions), list(gateway.levels),
                     time.perf_counter() - started_s)  # fmt: skip


def run_overload(
    config: OverloadConfig, on_done: Callable[[str, float], None] | None = None
) -> OverloadResult:
    """Capacity (unless given), then both arms on the same arrivals."""
    capacity = None
    rate = config.capacity_per_s
    if rate is None:
        started_s = time.perf_counter()
        capacity = measure_capacity(config.spec(), config.mix,
                                    num_requests=config.capacity_requests,
                                    seed=config.seed)  # fmt: skip
        rate = capacity.requests_per_s
        if on_done is not None:
            on_done("capacity", time.perf_counter() - started_s)
    schedule = arrivals(config.mix, config.phases, rate, seed=config.seed)
    result = OverloadResult(config, capacity, rate, len(schedule))
    for name in ARM_NAMES:
        arm = run_arm(config, name, schedule)
        result.arms.append(arm)
        if on_done is not None:
            on_done(name, arm.wall_s)
    return result
