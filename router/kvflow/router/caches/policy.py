"""Which requests the response cache may answer or store: pure.

Only deterministic requests: the same request must be able to get the same answer from the
model, or replaying one would hide the variety the caller asked for. So a request needs
temperature 0 or a fixed ``seed``; several choices (``n > 1``) need a seed (each choice then
has its own reproducible stream). Requests for logprobs are not cached (their numbers vary
with batching far more than the text). The caller can opt out per request; the operator per
tenant (``response_cache: false``).

Under a model's ``response_cache`` degradation step (degrade/, docs/router.md "When demand
exceeds supply") a request skipped only because it samples (temperature > 0 without a
seed, one choice, no logprobs) is looked up as its greedy twin: the same request at
temperature 0. A stored greedy answer is then one the model could have given; a degraded
pool serving it saves the generation. Such a request is never stored: its answer is a
sample, not the greedy one its twin's key promises.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from kvflow.router.protocol.requests import SamplingOptions

# The request header a caller turns the cache off with for one request.
CACHE_OFF_HEADER = "x-kvflow-cache"
# The response header saying what the cache did.
RESULT_HEADER = "x-kvflow-response-cache"

# Why a request skips the cache (metric label values; bounded).
BYPASS_REASONS = ("header", "no_store", "tenant", "temperature", "n", "logprobs")

Result = Literal["hit", "miss", "bypass"]


@dataclass(frozen=True)
class Decision:
    """May the cache be read (``is_lookup``), and may the fresh answer be stored."""

    bypass: str | None = None  # one of BYPASS_REASONS: neither read nor stored
    # Cache-Control: no-cache: the stored answer is not used, the fresh one replaces it.
    is_refresh: bool = False
    # A sampled request under the response_cache step: its greedy twin's answer is read,
    # and its own never stored.
    is_twin: bool = False

    @property
    def is_lookup(self) -> bool:
        return self.bypass is None and not self.is_refresh

    @property
    def is_store(self) -> bool:
        return self.bypass is None and not self.is_twin


def decide(
    headers: Mapping[str, str],
    sampling: SamplingOptions,
    *,
    tenant_allows: bool,
    serves_sampled: bool = False,
) -> Decision:
    """``sampling``: the request's, with the pool's defaults filled in (a model whose
    default temperature is 0 makes a request that leaves it out deterministic).
    ``serves_sampled``: the model's response_cache degradation step is active."""
    if headers.get(CACHE_OFF_HEADER, "").strip().lower() in ("off", "false", "0", "no"):
        return Decision("header")
    directives = _cache_control(headers.get("cache-control", ""))
    if "no-store" in directives:
        return Decision("no_store")
    if not tenant_allows:
        return Decision("tenant")
    is_seeded = sampling.seed is not None
    # None is OpenAI's default of 1.
    temperature = 1.0 if sampling.temperature is None else sampling.temperature
    if temperature > 0 and not is_seeded:
        # A refresh (no-cache) of a sampled answer would store it: the twin is not read.
        is_twin = (
            serves_sampled and sampling.n == 1 and not (sampling.logprobs or sampling.top_logprobs)
        )
        if is_twin and "no-cache" not in directives:
            return Decision(is_twin=True)
        return Decision("temperature")
    if sampling.n > 1 and not is_seeded:
        return Decision("n")
    if sampling.logprobs:
        return Decision("logprobs")
    return Decision(is_refresh="no-cache" in directives)


def greedy_twin(sampling: SamplingOptions) -> SamplingOptions:
    """The sampling a twin is looked up with: temperature 0 (the key leaves out what greedy
    decoding ignores: caches/key.py)."""
    return replace(sampling, temperature=0.0)


def _cache_control(value: str) -> set[str]:
    return {part.split("=", 1)[0].strip().lower() for part in value.split(",") if part.strip()}
