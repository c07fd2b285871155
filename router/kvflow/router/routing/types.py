"""The records routing plugins read: workers as last observed, and the request to place."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NewType

from kvflow.proto.block_hash import BlockHash
from kvflow.proto.roles import Role
from kvflow.router.breaker.machine import CircuitState

# A measure, not a scorer: the chosen worker's cached prompt blocks past the skip, which
# the prefix scorer and the time scorer both report beside their values
# (RouteDecision.scores). The `x-kvflow-route` header prints it under this name, placement
# and the simulator read it, and `kvflow bench` parses it.
PREFIX_BLOCKS = "prefix_blocks"
# Beside it: the most prompt blocks past the skip that any candidate held (the best holder's),
# and 1 when the rent-or-buy rule sent the request to copy a shared prefix (replicas.py).
# Together they say why a request missed cache it could have hit (kvflow.proto.prefix_outcome).
BEST_PREFIX_BLOCKS = "best_prefix_blocks"
PREFIX_COPY = "prefix_copy"

WorkerId = NewType("WorkerId", str)
"""A worker's gRPC address, "host:port": stable across the worker's restarts."""


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router last saw it."""

    worker_id: WorkerId
    model: str
    role: Role
    is_healthy: bool
    # Requests waiting or running there: the worker's last report, plus what this router
    # has sent since (see workers.book.estimate_queue_depth).
    queue_depth: int
    kv_usage: float  # fraction of the worker's KV blocks held by requests, 0..1
    # It keeps prompts' blocks and publishes them as KV events (WorkerInfo.prefix_caching):
    # only then does placement count a prompt it just sent as held there.
    caches_prefixes: bool = True
    # The load in tokens, for the time-based scorer (routing/cost.py), from the worker's
    # last load report; 0 where the worker does not report it. Prompt tokens waiting or
    # running that are not computed yet; requests past their prompt; the KV tokens those
    # hold and read each step; the worker's KV capacity (0: unknown, no memory term).
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_kv_tokens: int = 0
    kv_capacity_tokens: int = 0
    num_cached_tokens: int = 0  # in the prefix cache (LoadResponse.num_cached_blocks x size)
    # When that report was taken, on the clock placement is given (None: unknown): work
    # placed after it is added by the router (routing/cost.py, PlacedWork).
    load_at_s: float | None = None
    # Its circuit breaker (kvflow.router.breaker) as routing reads it now: OPEN takes
    # nothing (also a half-open circuit whose probes are all out), HALF_OPEN one probe.
    circuit: CircuitState = CircuitState.CLOSED


@dataclass(frozen=True)
class RouteRequest:
    model: str
    # The prompt's block hashes, lazily: the prefix scorer stops at the first block no
    # candidate holds, so a cold 8k-token prompt costs one hash, not 512.
    block_hashes: Iterable[BlockHash]
    session_id: str | None = None
    # Workers that already failed this request (failover).
    excluded: frozenset[WorkerId] = field(default_factory=frozenset)
    # Leading blocks that need no computing wherever this request lands (the decode worker
    # of a disaggregated plan holds them): the prefix scorer counts only blocks past them.
    num_skip_blocks: int = 0
    # The prompt's length and block size (the time-based scorer's uncached tokens).
    num_prompt_tokens: int = 0
    block_size: int = 16


@dataclass(frozen=True)
class RouteDecision:
    worker_id: WorkerId
    score: float
    # Each scorer's raw value for the chosen worker, before weighting: why it won; then
    # the measures scorers report beside it (PREFIX_BLOCKS).
    scores: dict[str, float]
    num_candidates: int
    role: Role = Role.COLOCATED
    # The chosen worker's circuit (HALF_OPEN: this request is one of its probes), and the
    # workers the circuit filter left out, their circuits open, that were otherwise fit.
    circuit: CircuitState = CircuitState.CLOSED
    circuit_open: tuple[WorkerId, ...] = ()

    def explain(self, prefix: str = "") -> list[str]:
        """``score=..``, each scorer's value, ``candidates=..``, the circuit breaker's part
        (``circuit=half_open`` for a probe, ``circuit_open=`` the workers it left out), names
        prefixed by ``prefix``."""
        parts = [f"{prefix}score={self.score:g}"]
        parts += [f"{prefix}{name}={value:g}" for name, value in self.scores.items()]
        parts.append(f"{prefix}candidates={self.num_candidates}")
        if self.circuit is not CircuitState.CLOSED:
            parts.append(f"{prefix}circuit={self.circuit.label}")
        if self.circuit_open:
            # "|" between them: routes are separated by ", " (and parsers split on ",").
            parts.append(f"{prefix}circuit_open={'|'.join(self.circuit_open)}")
        return parts

    def header_value(self) -> str:
        """The `x-kvflow-route` response header: worker, total and each scorer's value."""
        return "; ".join([f"worker={self.worker_id}", *self.explain()])
