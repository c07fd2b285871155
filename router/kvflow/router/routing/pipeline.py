"""The routing pipeline: filters -> weighted scorers -> picker, wired from configuration."""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS, StepCosts, TimeCostScorer, WaitGate
from kvflow.router.routing.plugins import (
    CircuitFilter,
    ExcludedFilter,
    Filter,
    HealthyFilter,
    KvCacheUsageScorer,
    LoadGate,
    MaxScorePicker,
    ModelFilter,
    Picker,
    PrefixCacheScorer,
    QueueDepthScorer,
    RoleFilter,
    Scorer,
    SessionAffinityScorer,
)
from kvflow.router.routing.replicas import ReplicaLedger
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerView,
)

# score = - the seconds the request would cost on the worker (routing/cost.py: its queued
# and own prefill, its decode beside the worker's decodes, the stall it puts on those, the
# KV it would evict) + 0.01 s for the session's last worker (a tie-break between workers
# within 10 ms of each other: the session's history is already in the time, as cached
# blocks). Why time and not blocks and requests: docs/router.md, "Routing".
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "time_cost": 1.0,
    "session": 0.01,
}

# The previous default, selectable by these weights (`routing.weights`) and as the
# comparison's `kvflow-blocks` arm: 1 x cached prefix blocks - 1 x queue depth + 8 x same
# session. One cached block (16 tokens of prefill saved) weighs as much as one queued
# request; returning to a session's worker as eight. The KV-usage scorer is off (weight
# 0): its reading is up to 250 ms old, so a worker just sent a long prompt still looks
# empty and draws the next one too (docs/benchmarks.md, "Routing comparison").
BLOCK_WEIGHTS: Mapping[str, float] = {
    "prefix_cache": 1.0,
    "queue_depth": 1.0,
    "session": 8.0,
}

# The block policy's own scorers: weights that name one of them (and not time_cost) start
# from BLOCK_WEIGHTS (settings.py), so that a configuration written for that policy, as
# the operator's CRD renders one, keeps meaning what it meant.
BLOCK_SCORERS = frozenset({"prefix_cache", "queue_depth", "kv_cache_usage"})

# Totals within this many seconds tie (the time scorer's picker): below what the model
# can tell apart, so equal workers take turns (plugins.MaxScorePicker).
TIME_TIE_S = 1e-3

# A worker whose queue is over 1.5 x the pool's mean + 4 gets nothing while another is
# under that line (plugins.LoadGate; why these numbers: docs/router.md, "Routing").
DEFAULT_LOAD_GATE = LoadGate(slack_fraction=0.5, slack_requests=4.0)
# With the time scorer, the same gate in seconds of queued prefill: over 1.5 x the mean + 1 s
# (a few long prompts' prefill) gets nothing while another worker is under it.
DEFAULT_WAIT_GATE_FRACTION = 0.5
DEFAULT_WAIT_GATE_SLACK_S = 1.0


class AutoGate(enum.Enum):
    """``build_pipeline``'s default gate: in seconds with the time scorer, else in
    requests."""

    AUTO = "auto"


# Workers that stream tokens to clients: `colocated` workers serve requests whole, `decode` workers
# prefill locally or receive a prefill worker's blocks (placement.py).
SERVING_ROLES = frozenset({Role.COLOCATED, Role.DECODE})


class RoutingConfigError(ValueError):
    """The routing section of the configuration names an unknown scorer or a bad weight."""


@dataclass(frozen=True)
class ScorerInputs:
    """What a scorer may be built from: the router's shared block index and session table,
    and the workers' step-time model."""

    index: BlockIndex
    sessions: SessionTable
    costs: StepCosts


# The scorers `routing.weights` may name, by the name each reports its value under. The
# names are the InferencePool CRD's `router.scorerWeights` fields in snake_case
# (prefixCache -> prefix_cache), so the operator writes a field's weight under its own
# name; tests/contracts/test_scorers.py holds the two to each other.
SCORERS: Mapping[str, Callable[[ScorerInputs], Scorer]] = MappingProxyType({
    "time_cost": lambda inputs: TimeCostScorer(inputs.index, inputs.costs,
                                               replicas=ReplicaLedger()),
    "prefix_cache": lambda inputs: PrefixCacheScorer(inputs.index),
    "queue_depth": lambda inputs: QueueDepthScorer(),
    "kv_cache_usage": lambda inputs: KvCacheUsageScorer(),
    "session": lambda inputs: SessionAffinityScorer(inputs.sessions),
})  # fmt: skip

_W = TypeVar("_W")  # a weight as configured: checked by build_pipeline

# Earlier names of scorers, still read in `routing.weights` so that configurations written
# before the scorers took the CRD's names keep working (docs/router.md, "Routing").
SCORER_ALIASES: Mapping[str, str] = MappingProxyType({
    "prefix_blocks": "prefix_cache",
    "kv_usage": "kv_cache_usage",
})  # fmt: skip


def canonical_weights(weights: Mapping[str, _W]) -> dict[str, _W]:
    """``weights`` with each alias (SCORER_ALIASES) replaced by the scorer's name; a scorer
    named twice, once by each, is refused: which weight was meant is unknowable."""
    canonical: dict[str, _W] = {}
    for name, weight in weights.items():
        scorer = SCORER_ALIASES.get(name, name)
        if scorer in canonical:
            raise RoutingConfigError(
                f"routing.weights names the scorer {scorer!r} twice (as {name!r} too)"
            )
        canonical[scorer] = weight
    return canonical


@dataclass(frozen=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class RoutingPipeline:
    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[WeightedScorer],
        picker: Picker,
        gate: LoadGate | WaitGate | None = None,
    ) -> None:
        self._filters = tuple(filters)
        self._scorers = tuple(scorers)
        self._picker = picker
        self._gate = gate

    @property
    def scorers(self) -> tuple[WeightedScorer, ...]:
        return self._scorers

    def candidates(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        """The workers every filter keeps."""
        return self._filter(request, workers)[0]

    def _filter(
        self, request: RouteRequest, workers: Sequence[WorkerView]
    ) -> tuple[list[WorkerView], tuple[WorkerId, ...]]:
        """The workers every filter keeps, and those the circuit filter alone dropped (for
        the route's explanation). Filter by filter over the list, not `all()` over a
        generator per worker: 15 % faster at 64 workers (docs/benchmarks.md, "Scale
        check")."""
        candidates = list(workers)
        circuit_open: tuple[WorkerId, ...] = ()
        for f in self._filters:
            kept = [w for w in candidates if f.keep(request, w)]
            if f.name == CircuitFilter.name and len(kept) < len(candidates):
                circuit_open = tuple(w.worker_id for w in candidates if not f.keep(request, w))
            candidates = kept
        return candidates, circuit_open

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision | None:
        """The best worker for ``request``, or None when every worker is filtered out."""
        candidates, circuit_open = self._filter(request, workers)
        if not candidates:
            return None
        gated_out: list[WorkerView] = []
        if self._gate is not None:
            kept = self._gate.keep(candidates)
            kept_ids = {w.worker_id for w in kept}
            gated_out = [w for w in candidates if w.worker_id not in kept_ids]
            candidates = kept
        totals = dict.fromkeys((w.worker_id for w in candidates), 0.0)
        per_scorer: dict[str, dict[WorkerId, float]] = {}
        for weighted in self._scorers:
            values = weighted.scorer.score(request, candidates)
            per_scorer[weighted.scorer.name] = values
            for worker_id, value in values.items():
                totals[worker_id] += weighted.weight * value
        chosen = self._picker.pick([(w, totals[w.worker_id]) for w in candidates])
        scores = {name: values[chosen.worker_id] for name, values in per_scorer.items()}
        for weighted in self._scorers:  # what a scorer reports beside its value
            details = getattr(weighted.scorer, "details", None)
            if details is not None:
                scores.update(details(chosen.worker_id))
        if gated_out and BEST_PREFIX_BLOCKS in scores:
            # A holder the gate left out for its load still held the prompt: the request
            # passed it over (prefix_outcome.py), it did not find the prefix nowhere.
            for weighted in self._scorers:
                best_of = getattr(weighted.scorer, "best_prefix_blocks", None)
                if best_of is not None:
                    best = best_of(request, gated_out)
                    scores[BEST_PREFIX_BLOCKS] = max(scores[BEST_PREFIX_BLOCKS], best)
                    break  # one index lookup: every prefix scorer reads the same index
        return RouteDecision(
            worker_id=chosen.worker_id,
            score=totals[chosen.worker_id],
            scores=scores,
            num_candidates=len(candidates),
            role=chosen.role,
            circuit=chosen.circuit,
            circuit_open=circuit_open,
        )


def build_pipeline(
    weights: Mapping[str, float],
    *,
    index: BlockIndex,
    sessions: SessionTable,
    rng: random.Random,
    roles: Iterable[Role] = SERVING_ROLES,
    gate: LoadGate | WaitGate | AutoGate | None = AutoGate.AUTO,
    costs: StepCosts = DEFAULT_STEP_COSTS,
) -> RoutingPipeline:
    """The default filters, workers of ``roles`` only, the load gate, and the scorers named
    in ``weights`` (SCORERS, or an alias; weight 0 drops a scorer). ``costs``: the
    workers' step-time model, for the time scorer and its gate."""
    inputs = ScorerInputs(index, sessions, costs)
    scorers = []
    for name, weight in canonical_weights(weights).items():
        if name not in SCORERS:
            raise RoutingConfigError(
                f"routing.weights names an unknown scorer {name!r}; known: {sorted(SCORERS)}"
                f" (and the earlier names {sorted(SCORER_ALIASES)})"
            )
        if not isinstance(weight, int | float) or not 0 <= weight < math.inf:  # NaN too
            raise RoutingConfigError(
                f"routing.weights.{name} must be a number >= 0, got {weight!r}"
            )
        if weight > 0:
            scorers.append(WeightedScorer(SCORERS[name](inputs), float(weight)))
    filters: list[Filter] = [HealthyFilter(), ModelFilter(), RoleFilter(roles), ExcludedFilter(),
                             CircuitFilter()]  # fmt: skip
    is_timed = any(w.scorer.name == "time_cost" for w in scorers)
    if gate is AutoGate.AUTO:
        gate = DEFAULT_LOAD_GATE
        if is_timed:
            gate = WaitGate(costs, DEFAULT_WAIT_GATE_FRACTION, DEFAULT_WAIT_GATE_SLACK_S)
    picker = MaxScorePicker(rng, TIME_TIE_S) if is_timed else MaxScorePicker(rng)
    return RoutingPipeline(filters, scorers, picker, gate)
