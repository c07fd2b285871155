"""The records routing plugins read: workers as last observed, and the request to place."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NewType

from kvflow.proto.block_hash import BlockHash

WorkerId = NewType("WorkerId", str)
"""A worker's gRPC address, "host:port": stable across the worker's restarts."""


class WorkerRole(enum.Enum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerView:
    """One worker as the router last saw it."""

    worker_id: WorkerId
    model: str
    role: WorkerRole
    is_healthy: bool
    # Requests waiting or running there: the worker's last report, plus what this router
    # has sent since (see workers.load.estimate_queue_depth).
    queue_depth: int
    kv_usage: float  # fraction of the worker's KV blocks held by requests, 0..1
    # It keeps prompts' blocks and publishes them as KV events (WorkerInfo.prefix_caching):
    # only then does placement count a prompt it just sent as held there.
    caches_prefixes: bool = True


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


@dataclass(frozen=True)
class RouteDecision:
    worker_id: WorkerId
    score: float
    # Each scorer's raw value for the chosen worker, before weighting: why it won.
    scores: dict[str, float]
    num_candidates: int
    role: WorkerRole = WorkerRole.BOTH

    def explain(self, prefix: str = "") -> list[str]:
        """``score=..``, each scorer's value, ``candidates=..``, names prefixed by ``prefix``."""
        parts = [f"{prefix}score={self.score:g}"]
        parts += [f"{prefix}{name}={value:g}" for name, value in self.scores.items()]
        parts.append(f"{prefix}candidates={self.num_candidates}")
        return parts

    def header_value(self) -> str:
        """The `x-kvflow-route` response header: worker, total and each scorer's value."""
        return "; ".join([f"worker={self.worker_id}", *self.explain()])
