"""Where a request went relative to the cache its prompt could have hit: the answer to "why
is the hit rate under what the cache could give?". Pure: it reads a decision's measures.

- ``best_holder``: to a worker holding as much of the prompt as any candidate, and some.
- ``passed_over``: past the best holder, for its load (its queue or decodes cost more than
  the prefill the hit saves): more capacity, not a larger cache, raises the hit rate.
- ``copy``: past the best holder to copy a shared prefix there (the rent-or-buy rule).
- ``no_prefix``: no candidate held any of it: a new prefix, or one evicted everywhere (a
  larger KV cache, or fewer prefixes per worker, raises the hit rate).

A decision without the prefix measures (the prefix scorers weighted out) has no outcome.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    PREFIX_BLOCKS,
    PREFIX_COPY,
    RouteRequest,
    WorkerView,
)


class PrefixOutcome(enum.Enum):
    BEST_HOLDER = "best_holder"
    PASSED_OVER = "passed_over"
    COPY = "copy"
    NO_PREFIX = "no_prefix"


def prefix_outcome(scores: Mapping[str, float]) -> PrefixOutcome | None:
    """The outcome of a decision whose measures are ``scores`` (RouteDecision.scores)."""
    chosen = scores.get(PREFIX_BLOCKS)
    best = scores.get(BEST_PREFIX_BLOCKS)
    if chosen is None or best is None:
        return None
    if best <= 0:
        return PrefixOutcome.NO_PREFIX
    if chosen >= best:
        return PrefixOutcome.BEST_HOLDER
    return PrefixOutcome.COPY if scores.get(PREFIX_COPY, 0.0) > 0 else PrefixOutcome.PASSED_OVER


def best_held_blocks(
    index: BlockIndex, request: RouteRequest, workers: Sequence[WorkerView]
) -> float:
    """The most prompt blocks past the request's skip that any of ``workers`` holds (the
    prefix scorers' ``best_prefix_blocks``, for the workers a load gate left out)."""
    matched = index.match_prefix(request.block_hashes, (w.worker_id for w in workers))
    return float(max(0, max(matched.values(), default=0) - request.num_skip_blocks))
