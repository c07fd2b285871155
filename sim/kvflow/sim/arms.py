"""The routing policies a comparison runs side by side, each built on the real pipeline.

- ``kvflow``: the gateway's placement with its default weights and load gate (what ships:
  the time-based scorer, routing/cost.py), given the cluster profile's step model.
- ``kvflow-blocks``: the previous default (cached prefix blocks - queue depth + 8 x
  session, the load gate in requests), for comparison.
- ``round-robin``: the default filters and a picker that takes the next worker in turn.
- ``random``: the default filters and a picker that draws any worker at random.
- ``least-loaded``: the queue-depth scorer alone.
- ``session``: sticky sessions: the session scorer at a weight no queue outweighs, new
  sessions to the least loaded.
- ``ideal``: least-loaded routing whose workers are charged nothing for any prompt block
  that any worker computed before (one infinite cache shared by all): perfect balance and
  perfect hits, the upper bound no router reaches.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import (
    DEFAULT_PREFILL_STALL_WEIGHT,
    StepCosts,
    TimeCostScorer,
    WaitGate,
)
from kvflow.router.routing.pipeline import (
    BLOCK_WEIGHTS,
    DEFAULT_LOAD_GATE,
    DEFAULT_WAIT_GATE_FRACTION,
    DEFAULT_WAIT_GATE_SLACK_S,
    DEFAULT_WEIGHTS,
    SCORER_ALIASES,
    SCORERS,
    SERVING_ROLES,
    RoutingPipeline,
    build_pipeline,
)
from kvflow.router.routing.placement import (
    DEFAULT_IN_FLIGHT_TTL_S,
    PREFILL_ROLES,
    Colocated,
    DisaggregationConfig,
    ExecutionPlan,
    Placement,
    PlacementRequest,
    PlanReason,
    build_placement,
)
from kvflow.router.routing.plugins import (
    ExcludedFilter,
    HealthyFilter,
    LoadGate,
    ModelFilter,
    RandomPicker,
    RoleFilter,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerView

# Sticky: a session returns to its worker unless that worker has 1,000 more requests.
STICKY_SESSION_WEIGHT = 1000.0


class Planner(Protocol):
    def plan(
        self, request: PlacementRequest, workers: Sequence[WorkerView], now_s: float | None = None
    ) -> ExecutionPlan | None: ...


class RoundRobinPicker:
    """The next candidate in turn (candidates come in the pool's fixed order)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView:
        return scored[next(self._turn) % len(scored)][0]


class ColocatedPlanner:
    """A single pipeline that always serves colocated (the baselines)."""

    def __init__(self, pipeline: RoutingPipeline) -> None:
        self._pipeline = pipeline

    def plan(
        self, request: PlacementRequest, workers: Sequence[WorkerView], now_s: float | None = None
    ) -> Colocated | None:
        """(``now_s`` unused: the baselines keep no memory of their placements.)"""
        route = RouteRequest(
            request.model, request.block_hashes, request.session_id, request.excluded
        )
        decision = self._pipeline.route(route, workers)
        return None if decision is None else Colocated(decision, PlanReason.COLOCATED_WORKER)


def _filters() -> list[HealthyFilter | ModelFilter | RoleFilter | ExcludedFilter]:
    return [HealthyFilter(), ModelFilter(), RoleFilter(SERVING_ROLES), ExcludedFilter()]


# The router's index and sessions, the run's random stream, and the workers' step model.
Builder = Callable[[BlockIndex, SessionTable, random.Random, StepCosts], Planner]


@dataclass(frozen=True)
class Arm:
    name: str
    build: Builder
    is_ideal: bool = False  # workers charge nothing for globally cached prompt blocks


def _weights(weights: dict[str, float]) -> Builder:
    """One pipeline, no load gate: the baselines are the plain policies users know."""

    def build(
        index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
    ) -> Planner:
        pipeline = build_pipeline(weights, index=index, sessions=sessions, rng=rng, gate=None)
        return ColocatedPlanner(pipeline)

    return build


def _default(
    index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
) -> Planner:
    """What the gateway builds from a configuration without a routing section, given the
    workers' step model."""
    return build_placement(DEFAULT_WEIGHTS, DisaggregationConfig(), index=index,
                           sessions=sessions, rng=rng, costs=costs)  # fmt: skip


def _blocks(
    index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
) -> Planner:
    """The previous default: blocks, requests and its gate in requests."""
    return build_placement(BLOCK_WEIGHTS, DisaggregationConfig(), index=index,
                           sessions=sessions, rng=rng)  # fmt: skip


Gate = LoadGate | WaitGate | None


def _placement(
    weights: Mapping[str, float],
    gate: Callable[[StepCosts], Gate],
    in_flight_ttl_s: float,
    prefill_stall_weight: float = DEFAULT_PREFILL_STALL_WEIGHT,
) -> Builder:
    """The gateway's placement with other weights, another gate, another in-flight TTL or
    another time scorer's ``prefill_stall_weight`` (build_placement's two profiles: the
    prefill one without session affinity)."""

    def build(
        index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
    ) -> Planner:
        decode = build_pipeline(weights, index=index, sessions=sessions, rng=rng,
                                gate=gate(costs), costs=costs)  # fmt: skip
        prefill_weights = {name: w for name, w in weights.items() if name != "session"}
        prefill = build_pipeline(prefill_weights, index=index, sessions=sessions, rng=rng,
                                 roles=PREFILL_ROLES, gate=gate(costs), costs=costs)  # fmt: skip
        for pipeline in (decode, prefill):
            for weighted in pipeline.scorers:
                if isinstance(weighted.scorer, TimeCostScorer):
                    weighted.scorer.prefill_stall_weight = prefill_stall_weight
        return Placement(decode, prefill, index, DisaggregationConfig(), in_flight_ttl_s, costs)

    return build


def _round_robin(
    index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
) -> Planner:
    return ColocatedPlanner(RoutingPipeline(_filters(), [], RoundRobinPicker()))


def _random(
    index: BlockIndex, sessions: SessionTable, rng: random.Random, costs: StepCosts
) -> Planner:
    return ColocatedPlanner(RoutingPipeline(_filters(), [], RandomPicker(rng)))


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("kvflow", _default),
        Arm("kvflow-blocks", _blocks),
        Arm("round-robin", _round_robin),
        Arm("least-loaded", _weights({"queue_depth": 1.0})),
        Arm("random", _random),
        Arm("session", _weights({"session": STICKY_SESSION_WEIGHT, "queue_depth": 1.0})),
        Arm("ideal", _weights({"queue_depth": 1.0}), is_ideal=True),
    )
}


# The settings an arm spec may give besides scorer weights, and the arms that take each
# (the block default's gate counts requests, the time-based default's gate seconds; only
# the time scorer has a prefill stall).
ARM_SETTINGS: dict[str, tuple[str, ...]] = {
    "gate": ("kvflow", "kvflow-blocks"),
    "gate_fraction": ("kvflow", "kvflow-blocks"),
    "gate_s": ("kvflow",),
    "gate_requests": ("kvflow-blocks",),
    "in_flight_ttl": ("kvflow", "kvflow-blocks"),
    "prefill_stall": ("kvflow",),
}


def resolve_arm(spec: str) -> Arm:
    """An arm by name, or ``kvflow:<key>=<value>,...`` (``kvflow-blocks:...``): the
    gateway's placement with other routing weights (scorer names), load gate (``gate=off``,
    ``gate_fraction=``, and ``gate_s=`` for the time-based default's gate in seconds,
    ``gate_requests=`` for the block default's in requests), memory of its placements
    (``in_flight_ttl=<s>``, 0: none) or, for ``kvflow``, the time scorer's
    ``prefill_stall=<share>`` (routing/cost.py, ``prefill_stall_s``), the rest at their
    defaults."""
    if spec in ARMS:
        return ARMS[spec]
    name, _, settings = spec.partition(":")
    if name not in ("kvflow", "kvflow-blocks") or not settings:
        raise ValueError(
            f"unknown arm {spec!r}: use one of {', '.join(ARMS)} or kvflow:key=value,..."
        )
    is_timed = name == "kvflow"
    weights = dict(DEFAULT_WEIGHTS if is_timed else BLOCK_WEIGHTS)
    is_gated = True
    fraction = DEFAULT_WAIT_GATE_FRACTION if is_timed else DEFAULT_LOAD_GATE.slack_fraction
    slack = DEFAULT_WAIT_GATE_SLACK_S if is_timed else DEFAULT_LOAD_GATE.slack_requests
    in_flight_ttl_s = DEFAULT_IN_FLIGHT_TTL_S
    prefill_stall_weight = DEFAULT_PREFILL_STALL_WEIGHT
    for item in settings.split(","):
        key, _, value = item.partition("=")
        takers = ARM_SETTINGS.get(key)
        if takers is not None and name not in takers:
            raise ValueError(
                f"arm {spec!r}: {name} does not take the setting {key!r}; "
                f"the arms that take it: {', '.join(takers)}"
            )
        if key == "gate" and value == "off":
            is_gated = False
            continue
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"arm {spec!r}: {item!r} is not <key>=<number>") from None
        if key == "gate_fraction":
            fraction = number
        elif key == ("gate_s" if is_timed else "gate_requests"):
            slack = number
        elif key == "in_flight_ttl":
            if number < 0:
                raise ValueError(f"arm {spec!r}: in_flight_ttl must be >= 0")
            in_flight_ttl_s = number
        elif key == "prefill_stall":
            if number < 0:
                raise ValueError(f"arm {spec!r}: prefill_stall must be >= 0")
            prefill_stall_weight = number
        elif key in SCORERS or key in SCORER_ALIASES:
            weights[key] = number
        else:
            raise ValueError(
                f"arm {spec!r}: {key!r} is neither a setting ({', '.join(ARM_SETTINGS)}) "
                f"nor a scorer ({', '.join(sorted(SCORERS))})"
            )

    def gate(costs: StepCosts) -> Gate:
        if not is_gated:
            return None
        return WaitGate(costs, fraction, slack) if is_timed else LoadGate(fraction, slack)

    return Arm(spec, _placement(weights, gate, in_flight_ttl_s, prefill_stall_weight))
