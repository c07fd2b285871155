"""The routing pipeline: filters -> weighted scorers -> picker, wired from configuration."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.plugins import (
    ExcludedFilter,
    Filter,
    HealthyFilter,
    KvUsageScorer,
    LoadGate,
    MaxScorePicker,
    ModelFilter,
    Picker,
    PrefixBlocksScorer,
    QueueDepthScorer,
    RoleFilter,
    Scorer,
    SessionAffinityScorer,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import (
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerRole,
    WorkerView,
)

# score = 1 x cached prefix blocks - 1 x queue depth + 8 x same session.
# One cached block (16 tokens of prefill saved) weighs as much as one queued request;
# returning to a session's worker as eight, enough to keep a conversation in place against
# small load differences but not against a real backlog. The KV-usage scorer is off by
# default (weight 0, as the operator's CRD has it): its reading is up to 250 ms old, so a
# worker just sent a long prompt still looks empty and draws the next one too; on the
# routing comparison's no-reuse control a weight of 2 put the default 6-33 % behind
# least-loaded at TTFT P90 (docs/benchmarks.md, "No-reuse control").
DEFAULT_WEIGHTS: Mapping[str, float] = {
    "prefix_blocks": 1.0,
    "queue_depth": 1.0,
    "session": 8.0,
}

# A worker whose queue is over 1.5 x the pool's mean + 4 gets nothing while another is
# under that line (plugins.LoadGate; why these numbers: docs/router.md, "Routing").
DEFAULT_LOAD_GATE = LoadGate(slack_fraction=0.5, slack_requests=4.0)

# Workers that stream tokens to clients: `both` workers serve colocated, `decode` workers
# prefill locally or receive a prefill worker's blocks (placement.py).
SERVING_ROLES = frozenset({WorkerRole.BOTH, WorkerRole.DECODE})


class RoutingConfigError(ValueError):
    """The routing section of the configuration names an unknown scorer or a bad weight."""


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
        gate: LoadGate | None = None,
    ) -> None:
        self._filters = tuple(filters)
        self._scorers = tuple(scorers)
        self._picker = picker
        self._gate = gate

    def candidates(self, request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
        """The workers every filter keeps. Filter by filter over the list, not `all()` over
        a generator per worker: 15 % faster at 64 workers (docs/benchmarks.md, "Scale
        check")."""
        candidates = list(workers)
        for f in self._filters:
            candidates = [w for w in candidates if f.keep(request, w)]
        return candidates

    def route(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RouteDecision | None:
        """The best worker for ``request``, or None when every worker is filtered out."""
        candidates = self.candidates(request, workers)
        if not candidates:
            return None
        if self._gate is not None:
            candidates = self._gate.keep(candidates)
        totals = dict.fromkeys((w.worker_id for w in candidates), 0.0)
        per_scorer: dict[str, dict[WorkerId, float]] = {}
        for weighted in self._scorers:
            values = weighted.scorer.score(request, candidates)
            per_scorer[weighted.scorer.name] = values
            for worker_id, value in values.items():
                totals[worker_id] += weighted.weight * value
        chosen = self._picker.pick([(w, totals[w.worker_id]) for w in candidates])
        return RouteDecision(
            worker_id=chosen.worker_id,
            score=totals[chosen.worker_id],
            scores={name: values[chosen.worker_id] for name, values in per_scorer.items()},
            num_candidates=len(candidates),
            role=chosen.role,
        )


def build_pipeline(
    weights: Mapping[str, float],
    *,
    index: BlockIndex,
    sessions: SessionTable,
    rng: random.Random,
    roles: Iterable[WorkerRole] = SERVING_ROLES,
    gate: LoadGate | None = DEFAULT_LOAD_GATE,
) -> RoutingPipeline:
    """The default filters, workers of ``roles`` only, the load gate, and the scorers named
    in ``weights`` (weight 0 drops a scorer)."""
    available: dict[str, Scorer] = {
        "prefix_blocks": PrefixBlocksScorer(index),
        "queue_depth": QueueDepthScorer(),
        "kv_usage": KvUsageScorer(),
        "session": SessionAffinityScorer(sessions),
    }
    scorers = []
    for name, weight in weights.items():
        if name not in available:
            raise RoutingConfigError(
                f"routing.weights names an unknown scorer {name!r}; known: {sorted(available)}"
            )
        if not isinstance(weight, int | float) or weight < 0:
            raise RoutingConfigError(
                f"routing.weights.{name} must be a number >= 0, got {weight!r}"
            )
        if weight > 0:
            scorers.append(WeightedScorer(available[name], float(weight)))
    filters: list[Filter] = [HealthyFilter(), ModelFilter(), RoleFilter(roles), ExcludedFilter()]
    return RoutingPipeline(filters, scorers, MaxScorePicker(rng), gate)
