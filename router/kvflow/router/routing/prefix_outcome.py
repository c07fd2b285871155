"""A decision's prefix outcome (kvflow.proto.prefix_outcome: best_holder, passed_over, copy,
no_prefix) from its measures, and the best holder's blocks among workers the scorers did not
see. Pure but for the index read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.proto.prefix_outcome import PrefixOutcome, classify_prefix
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    PREFIX_BLOCKS,
    PREFIX_COPY,
    RouteRequest,
    WorkerView,
)

__all__ = ["PrefixOutcome", "best_held_blocks", "prefix_outcome"]


def prefix_outcome(scores: Mapping[str, float]) -> PrefixOutcome | None:
    """The outcome of a decision whose measures are ``scores`` (RouteDecision.scores); None
    without the prefix measures (the prefix scorers weighted out)."""
    chosen = scores.get(PREFIX_BLOCKS)
    best = scores.get(BEST_PREFIX_BLOCKS)
    if chosen is None or best is None:
        return None
    return classify_prefix(chosen, best, scores.get(PREFIX_COPY, 0.0) > 0)


def best_held_blocks(
    index: BlockIndex, request: RouteRequest, workers: Sequence[WorkerView]
) -> float:
    """The most prompt blocks past the request's skip that any of ``workers`` holds (the
    prefix scorers' ``best_prefix_blocks``, for the workers a load gate left out)."""
    matched = index.match_prefix(request.block_hashes, (w.worker_id for w in workers))
    return float(max(0, max(matched.values(), default=0) - request.num_skip_blocks))
