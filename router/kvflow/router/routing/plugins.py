"""Routing plugins: filters drop workers, scorers rate them, a picker chooses.

Scorers return values in their own, named units (blocks, requests, a fraction) rather
than values clamped to [0, 1]: the default policy is literally "cached prefix blocks
matched minus queue depth", and normalising blocks by prompt length would make one cached
block of a two-block prompt weigh as much as 500 cached blocks of an 8k-token prompt
against the same queue. Weights (pipeline.py) convert units; a higher total wins.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Protocol

from kvflow.proto.roles import Role
from kvflow.router.breaker.machine import CircuitState
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.prefix_outcome import best_held_blocks
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    PREFIX_BLOCKS,
    RouteRequest,
    WorkerId,
    WorkerView,
)


class Filter(Protocol):
    name: str

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool: ...


class Scorer(Protocol):
    name: str

    def score(
        self, request: RouteRequest, workers: Sequence[WorkerView]
    ) -> dict[WorkerId, float]: ...


class Picker(Protocol):
    def pick(self, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView: ...


# -- filters -------------------------------------------------------------------------------


class HealthyFilter:
    name = "healthy"

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool:
        return worker.is_healthy


class ModelFilter:
    name = "model"

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool:
        return worker.model == request.model


class RoleFilter:
    """A profile's roles: the decode profile takes `colocated` and `decode` workers, the prefill
    profile `prefill` workers (placement.py)."""

    name = "role"

    def __init__(self, roles: Iterable[Role]) -> None:
        self._roles = frozenset(roles)

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool:
        return worker.role in self._roles


class ExcludedFilter:
    """Failover: workers that already failed this request are not tried again."""

    name = "not-failed"

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool:
        return worker.worker_id not in request.excluded


class CircuitFilter:
    """Workers whose circuit breaker is open take nothing; a half-open one takes probes
    while it has one to spare (its view says HALF_OPEN then, OPEN once they are out)."""

    name = "circuit"

    def keep(self, request: RouteRequest, worker: WorkerView) -> bool:
        return worker.circuit is not CircuitState.OPEN


# -- scorers -------------------------------------------------------------------------------


class PrefixCacheScorer:
    """Leading prompt blocks the worker already caches, past the request's
    ``num_skip_blocks`` (unit: blocks). For a prefill worker that is its cached share of
    what the decode worker lacks: blocks decode holds are never sent, so they save nothing."""

    name = "prefix_cache"

    def __init__(self, index: BlockIndex) -> None:
        self._index = index
        self._matched: dict[WorkerId, float] = {}  # of the last ``score`` call

    def details(self, worker_id: WorkerId) -> dict[str, float]:
        """The chosen worker's count as the ``prefix_blocks`` measure, which the route
        header, placement and the simulator read whichever prefix scorer ran."""
        return {PREFIX_BLOCKS: self._matched.get(worker_id, 0.0),
                BEST_PREFIX_BLOCKS: max(self._matched.values(), default=0.0)}  # fmt: skip

    def best_prefix_blocks(self, request: RouteRequest, workers: Sequence[WorkerView]) -> float:
        """The most prompt blocks past the skip that any of ``workers`` holds (the pipeline
        asks for the workers its load gate left out)."""
        return best_held_blocks(self._index, request, workers)

    def score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[WorkerId, float]:
        matched = self._index.match_prefix(request.block_hashes, (w.worker_id for w in workers))
        skip = request.num_skip_blocks
        self._matched = {worker_id: float(max(0, n - skip)) for worker_id, n in matched.items()}
        return dict(self._matched)


class QueueDepthScorer:
    """Minus the requests waiting or running on the worker (unit: requests)."""

    name = "queue_depth"

    def score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[WorkerId, float]:
        return {w.worker_id: 0.0 - w.queue_depth for w in workers}  # 0.0 - 0 is 0, not -0


class KvCacheUsageScorer:
    """Minus the fraction of the worker's KV blocks in use (unit: fraction, 0..1).

    A nearly full cache means the next long prompt evicts or preempts there.
    """

    name = "kv_cache_usage"

    def score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[WorkerId, float]:
        return {w.worker_id: 0.0 - w.kv_usage for w in workers}


class SessionAffinityScorer:
    """1 for the worker that served this session last, 0 for the others."""

    name = "session"

    def __init__(self, sessions: SessionTable) -> None:
        self._sessions = sessions

    def score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[WorkerId, float]:
        last = self._sessions.get(request.session_id) if request.session_id else None
        return {w.worker_id: 1.0 if w.worker_id == last else 0.0 for w in workers}


# -- load gate ----------------------------------------------------------------------------


class LoadGate:
    """Between the filters and the scorers: drop the workers whose queue is longer than
    ``(1 + slack_fraction) x`` the candidates' mean queue plus ``slack_requests``, unless
    that would drop them all.

    The scorers then weigh cached blocks against queue depth among workers that are not
    much busier than average, so a cached prefix can no longer pile work onto one worker:
    once its worker is over the line, a hot prefix's next request goes elsewhere, and that
    worker caches the prefix too (replication, from the events, with no extra machinery).
    Relative to the mean and not the minimum, with slack for small queues, so a momentary
    dip on one worker or a few requests' noise do not push requests off their cache (which
    costs a whole prefix's prefill): on the routing comparison's shared-prefix ladder
    (docs/benchmarks.md) a tighter line (mean x 1.25 + 2) lost 5 points of hit rate.
    """

    name = "load_gate"

    def __init__(self, slack_fraction: float = 0.5, slack_requests: float = 4.0) -> None:
        assert slack_fraction >= 0 and slack_requests >= 0
        self.slack_fraction = slack_fraction
        self.slack_requests = slack_requests

    def limit(self, workers: Sequence[WorkerView]) -> float:
        mean = sum(w.queue_depth for w in workers) / len(workers)
        return mean * (1.0 + self.slack_fraction) + self.slack_requests

    def keep(self, workers: Sequence[WorkerView]) -> list[WorkerView]:
        if not workers:
            return []
        limit = self.limit(workers)
        under = [w for w in workers if w.queue_depth <= limit]
        return under or list(workers)


# -- picker --------------------------------------------------------------------------------


class MaxScorePicker:
    """The highest total. Totals within half a point of it tie (half a queued request or
    half a cached block: the integer scorers never tie by accident, while the KV-usage
    term, a fraction read up to 250 ms ago, no longer decides between workers that differ
    by less than a quarter of their cache). Ties go to the worker chosen least recently,
    then at random. (The time-based default, in seconds, ties within 1 ms: ``tie_points``.)

    Why least recently and not at random: on the routing comparison's no-reuse control
    (docs/benchmarks.md) the queue depth of a worker that was just sent a long prompt
    often still equals the others', and a random tie-break sends it the next prompt too,
    where that prompt waits behind the first's prefill; round-robin, which never returns
    to a worker before the others had a turn, was 3x better there than least-loaded with
    random ties. Least recently chosen spreads equal workers the way round-robin does.
    """

    TIE_POINTS = 0.5

    def __init__(self, rng: random.Random, tie_points: float = TIE_POINTS) -> None:
        assert tie_points >= 0
        self._rng = rng
        self._tie_points = tie_points
        self._num_picks = 0
        # Worker -> the pick number that chose it last. Bounded by the workers this pool
        # has ever had (ids of workers that left stay: a few dozen bytes each).
        self._last_pick: dict[WorkerId, int] = {}

    def pick(self, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView:
        assert scored, "the pipeline never calls the picker without candidates"
        best = max(score for _, score in scored)
        tied = [w for w, score in scored if score >= best - self._tie_points]
        if len(tied) > 1:
            oldest = min(self._last_pick.get(w.worker_id, -1) for w in tied)
            tied = [w for w in tied if self._last_pick.get(w.worker_id, -1) == oldest]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._num_picks += 1
        self._last_pick[chosen.worker_id] = self._num_picks
        return chosen


class RandomPicker:
    """Any candidate at random, whatever its score (the comparison's random arm)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView:
        assert scored, "the pipeline never calls the picker without candidates"
        return self._rng.choice([w for w, _ in scored])
