"""Where a request went relative to the cache its prompt could have hit, from the router's
measures (the gateway's ``x-kvflow-route`` header: ``prefix_blocks``, ``best_prefix_blocks``,
``prefix_copy``). The gateway counts it (docs/router.md, Metrics), ``kvflow bench`` and the
simulator report it per load point.

- ``best_holder``: to a worker holding as much of the prompt as any candidate, and some.
- ``passed_over``: past the best holder, for its load (its queue or decodes cost more than
  the prefill the hit saves): more capacity, not a larger cache, raises the hit rate.
- ``copy``: past the best holder to copy a shared prefix there (the rent-or-buy rule).
- ``no_prefix``: no candidate held any of it: a new prefix, or one evicted everywhere (a
  larger KV cache, or fewer prefixes per worker, raises the hit rate).
"""

from __future__ import annotations

import enum


class PrefixOutcome(enum.Enum):
    BEST_HOLDER = "best_holder"
    PASSED_OVER = "passed_over"
    COPY = "copy"
    NO_PREFIX = "no_prefix"


def classify_prefix(chosen_blocks: float, best_blocks: float, copied: bool) -> PrefixOutcome:
    """The outcome of sending a request to a worker holding ``chosen_blocks`` of its prompt
    when the best candidate held ``best_blocks``; ``copied``: the router sent it to copy a
    shared prefix (it counts only where the request did leave the best holder)."""
    if best_blocks <= 0:
        return PrefixOutcome.NO_PREFIX
    if chosen_blocks >= best_blocks:
        return PrefixOutcome.BEST_HOLDER
    return PrefixOutcome.COPY if copied else PrefixOutcome.PASSED_OVER
