"""Placement: where one choice of a request runs, as an execution plan. Pure: no I/O.

The decode profile (`both` and `decode` workers, scored as configured: cached prefix blocks
minus queue depth by default) picks the worker that streams tokens. A plan names its
workers and why; serving/ carries it out. A retry asks for a new plan with the failed
workers excluded; a plan is never patched.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvflow.proto.block_hash import BlockHash
from kvflow.router.routing.pipeline import RoutingPipeline
from kvflow.router.routing.types import RouteDecision, RouteRequest, WorkerId, WorkerView


class PlanReason(enum.Enum):
    """Why a plan has the shape it has (a bounded metric label)."""

    COLOCATED_WORKER = "colocated_worker"  # the best worker serves prefill and decode itself


@dataclass(frozen=True)
class PlacementRequest:
    model: str
    # Must start over on every pass (a list, or routing.block_hasher.PromptHashes).
    block_hashes: Iterable[BlockHash]
    num_prompt_tokens: int
    block_size: int
    session_id: str | None = None
    # Workers that already failed this choice.
    excluded: frozenset[WorkerId] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Colocated:
    """One worker prefills and decodes."""

    worker: RouteDecision
    reason: PlanReason
    decision = "colocated"

    @property
    def stream_worker(self) -> WorkerId:
        """The worker whose stream the client reads."""
        return self.worker.worker_id

    @property
    def matched_blocks(self) -> float:
        """Prompt blocks the streaming worker caches, per the index (0 without the scorer)."""
        return self.worker.scores.get("prefix_blocks", 0.0)

    def header_value(self) -> str:
        return "; ".join([f"worker={self.worker.worker_id}", f"plan={self.decision}",
                          f"reason={self.reason.value}", *self.worker.explain()])  # fmt: skip


ExecutionPlan = Colocated


class Placement:
    def __init__(self, decode: RoutingPipeline) -> None:
        self._decode = decode

    def plan(
        self, request: PlacementRequest, workers: Sequence[WorkerView]
    ) -> ExecutionPlan | None:
        """The plan for ``request``, or None when no worker can take it."""
        route = RouteRequest(
            request.model, request.block_hashes, request.session_id, request.excluded
        )
        decode = self._decode.route(route, workers)
        if decode is None:
            return None
        return Colocated(decode, PlanReason.COLOCATED_WORKER)
