"""The time a request would cost on each worker, in seconds: the default router's score.

A worker is scored by what sending the request there adds to everyone's latency, from the
worker's step-time model (``StepCosts``: the simulator's linear step model, the same
coefficients) and its load in tokens (``WorkerView``: prompt tokens still to prefill,
decoding sequences, the KV tokens they read):

    cost = own_ttft_s + own_decode_s + stall_s + evict_s + backlog_s (+ prefill_stall_s)

- ``own_ttft_s``: the prompt tokens queued ahead of it plus its own uncached tokens, at
  ``per_prefill_token_s``, and the step overhead of the steps that takes (each step also
  carries the worker's decodes: ``per_decode_seq_s`` each, ``per_kv_token_s`` per token
  of their context). A cached block is worth exactly the prefill time it saves.
- ``own_decode_s``: ``decode_horizon_tokens`` decode steps beside the worker's decodes
  (each step's share of theirs: their sequences and the KV they read).
- ``stall_s``: what it costs the requests already decoding there: each step of theirs
  carries its sequence and reads its KV, for the horizon. (Not its prefill step, which
  they wait through too: charging that as well made the cache hit worth its prefill time
  once per decoding neighbour, and on the agent family that piled sessions onto their
  workers and put TTFT P90 behind least-loaded's.)
- ``evict_s``: the tokens its prompt and horizon need past the worker's empty KV: cached
  prefixes pushed out (a later prompt prefills them again) or, on a full cache, a running
  request preempted and recomputed: at ``per_prefill_token_s``. With caches full of
  prefixes this makes a hit worth its prefill twice, once for this prompt and once for
  the prefix it does not push out; without it, on the shared-prefix comparison (prefixes
  3x one worker's KV) spreading groups by load thrashed every cache.
- ``backlog_s``: on a worker with requests waiting to prefill, its own prefill delays the
  requests that will queue behind it; as many as wait now (Little's law: a backlog keeps
  its length), at ``BACKLOG_WEIGHT``. Zero on a worker that keeps up, so there a cache
  hit is worth exactly its prefill time; past saturation a miss costs the capacity it
  takes, and hits are kept (on the shared-prefix comparison's overloaded rung, without
  it the hit rate fell to 0.6 of the ideal's).

- ``prefill_stall_s`` (off by default, ``prefill_stall_weight``): the step that
  prefills its uncached tokens stalls every sequence decoding there for that long, at
  ``prefill_stall_weight`` per decoding neighbour. Measured and left off: it trades the
  agent family's TTFT tail for the no-reuse control's TPOT (``DEFAULT_PREFILL_STALL_WEIGHT``).

A cached prefix many requests share is also worth copying to another worker once the
load its holder puts on them adds up to the copy's prefill: the rent-or-buy rule,
``TimeCostScorer(replicas=...)`` and replicas.py.

Constant terms (the base step time every worker pays alike) are left out: only
differences between workers decide. Why a time and not "cached blocks minus queued
requests": blocks and requests are not commensurable (one block of a 2-block prompt is not
one 7K-token prompt's prefill), and a request count treats a 7K-token prompt waiting to
prefill like a 10-token answer finishing; on conversation traces where every prompt
shares only a system prompt the block score stacked long prompts and decodes on the
workers that had a few more blocks (docs/benchmarks.md, "Trace families").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvflow.proto.block_hash import BlockHash
from kvflow.proto.step_model import StepTiming
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.prefix_outcome import best_held_blocks
from kvflow.router.routing.replicas import ReplicaLedger
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    PREFIX_BLOCKS,
    PREFIX_COPY,
    RouteRequest,
    WorkerId,
    WorkerView,
)


@dataclass(frozen=True)
class StepCosts:
    """One engine step's time model (seconds): the shared ``StepTiming``
    (kvflow.proto.step_model: ``base + per_prefill_token x prefill tokens + per_decode_seq x
    decoding sequences + per_kv_token x KV tokens read``; its per-prefill-sequence term is
    not used here, a few ms per prompt alike on every worker) and the most tokens a step
    batches."""

    timing: StepTiming
    max_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_batched_tokens < 1:
            raise ValueError(f"a step batches at least 1 token: {self}")


# H100-SXM x Llama-3-8B bf16, the simulator's roofline profile `h100-llama3-8b`
# (docs/simulator.md): 6.6 ms a step, 27.1 us a prompt token, 30.3 us a decoding sequence,
# 48.9 ns a KV token read, 8,192 tokens a step. What the gateway assumes for workers that
# publish no profile: only ratios between workers' costs decide, and those are the
# model's shape (prefill compute against decode memory reads), not the GPU's speed.
DEFAULT_STEP_COSTS = StepCosts(StepTiming(6.6e-3, 27.1e-6, 30.3e-6, 48.9e-9), 8192)
# Decode steps a new request is charged for, beside the worker's decodes. Not an answer's
# length: how much decode balance weighs against prefill waiting. Since shared prefixes
# are copied by the rent-or-buy rule (replicas.py), the requests that share one spread
# over its copies, and decode balance no longer has to come from sending a request away
# from its cached history: at 32 a follow-up turn left its ~3,000-token history for 4 or
# 5 more decoding neighbours, which made the agent family's TTFT tail (1.16-1.38x the
# ideal's). One value for every family (docs/benchmarks.md, "Routing comparison"), from
# 8, 16, 24 and 32 with copies: 8 lost the shared-prefix comparison's hit rate (0.85 of
# the ideal's at 40 req/s) and the Mooncake trace's (0.83 at 4x), 24 and 32 the agent
# family's tail (up to 1.24x the ideal's); 128 and 256 put TTFT P90 behind
# least-loaded's.
DEFAULT_DECODE_HORIZON_TOKENS = 16
# The share of a new prompt's prefill time charged per sequence decoding on the worker
# (``prefill_stall_s``): the prefill step stalls each of them that long. 0, off. On the
# routing comparison (docs/benchmarks.md, "Routing comparison", "Tried and left off") it is where
# least-loaded's steadier decodes come from (per request on the no-reuse control at 25
# req/s, a prefill stalled 4.59 decoding sequences under the time scorer, 4.16 under
# least-loaded), and at 0.75 it brings that control's TPOT P50 to 1.03x least-loaded's
# and the shared-prefix max/mean at 10 req/s to 1.17; but a cache hit then also saves its
# prefill once per decoding neighbour, follow-up turns wait behind their history worker's
# queue, and the agent family's TTFT P90 goes from 1.09 / 1.05 / 1.12x the ideal's to
# 1.15 / 1.32 / 1.38x at 1x / 2x / 4x (the no-reuse control's at 10 req/s to 1.10x
# least-loaded's). Charged on the prefill no worker can avoid (the least any candidate
# has uncached), it sent follow-ups away from their histories instead (agent 4x: 1.60x).
# In this scorer's own units (TTFT plus the horizon's steps of TPOT) its weight would be
# the horizon over the neighbours' answer (0.16 on that control), which changes nothing.
DEFAULT_PREFILL_STALL_WEIGHT = 0.0
# The share of a backlog's requests charged for a miss's prefill (``backlog_s``): 1 put
# the no-reuse control's TTFT P90 19 % behind least-loaded's at 60 req/s on 4 small
# workers (tests/sim/test_comparison_quick.py), 0.5 within 2 %; 0 lost the hit rate
# past saturation.
BACKLOG_WEIGHT = 0.5
# The rate a worker is assumed to work off its prompt tokens between load reports: half
# its prefill rate (steps also carry their base time and decodes). At the full rate the
# no-reuse control's TTFT P90 was 54 % behind least-loaded's (a worker just sent a prompt
# looked free before it was); at half, 17 % ahead.
PREFILL_DRAIN_FRACTION = 0.5


@dataclass(frozen=True)
class WorkerCost:
    """One worker's estimate for one request (seconds), and its parts."""

    own_ttft_s: float
    own_decode_s: float
    stall_s: float
    evict_s: float
    backlog_s: float
    num_uncached_tokens: int
    prefill_stall_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.own_ttft_s + self.own_decode_s + self.stall_s + self.evict_s
                + self.backlog_s + self.prefill_stall_s)  # fmt: skip


def worker_cost(
    worker: WorkerView,
    num_prompt_tokens: int,
    num_cached_tokens: int,
    costs: StepCosts,
    decode_horizon_tokens: int = DEFAULT_DECODE_HORIZON_TOKENS,
    prefill_stall_weight: float = DEFAULT_PREFILL_STALL_WEIGHT,
) -> WorkerCost:
    """The module docstring's terms for ``worker``."""
    assert prefill_stall_weight >= 0.0
    uncached = max(1, num_prompt_tokens - num_cached_tokens)  # the last token is computed
    decodes = worker.num_decode_seqs
    kv = worker.num_kv_tokens
    prefill = worker.num_prefill_tokens + uncached
    per_step_tokens = max(1, costs.max_batched_tokens - decodes)
    num_steps = math.ceil(prefill / per_step_tokens)
    decode_step_s = decodes * costs.timing.per_decode_seq_s + kv * costs.timing.per_kv_token_s
    own_ttft_s = prefill * costs.timing.per_prefill_token_s + num_steps * decode_step_s
    num_waiting = max(0, worker.queue_depth - decodes)
    backlog_s = BACKLOG_WEIGHT * num_waiting * uncached * costs.timing.per_prefill_token_s
    own_decode_s = decode_horizon_tokens * decode_step_s
    mine_s = costs.timing.per_decode_seq_s + num_prompt_tokens * costs.timing.per_kv_token_s
    stall_s = decodes * decode_horizon_tokens * mine_s
    prefill_stall_s = prefill_stall_weight * decodes * uncached * costs.timing.per_prefill_token_s
    evict_s = 0.0
    if worker.kv_capacity_tokens > 0:
        # Blocks are empty, cached (reusable by later prompts) or held by requests. Past
        # the empty ones, a prompt evicts cached blocks, and past those, running requests
        # (preempted, recomputed); either way that many tokens are prefilled again later.
        held = worker.num_kv_tokens + worker.num_prefill_tokens
        empty = worker.kv_capacity_tokens - max(held, worker.num_cached_tokens)
        evict_s = max(0, uncached + decode_horizon_tokens - max(0, empty)) * (
            costs.timing.per_prefill_token_s
        )
    return WorkerCost(own_ttft_s, own_decode_s, stall_s, evict_s, backlog_s, uncached,
                      prefill_stall_s)  # fmt: skip


class TimeCostScorer:
    """Minus the seconds the request costs on each worker (``worker_cost``): higher wins.

    The prompt's cached blocks come from the index (in-flight placements included) and
    count past ``num_skip_blocks`` only: a disaggregated plan's prefill candidate is
    credited for what the decode worker lacks."""

    name = "time_cost"

    def __init__(
        self,
        index: BlockIndex,
        costs: StepCosts = DEFAULT_STEP_COSTS,
        decode_horizon_tokens: int = DEFAULT_DECODE_HORIZON_TOKENS,
        replicas: ReplicaLedger | None = None,
        prefill_stall_weight: float = DEFAULT_PREFILL_STALL_WEIGHT,
    ) -> None:
        assert prefill_stall_weight >= 0.0
        self._index = index
        self.costs = costs
        self.decode_horizon_tokens = decode_horizon_tokens
        self.prefill_stall_weight = prefill_stall_weight
        # Rent or buy copies of shared prefixes (replicas.py); None: a hit is worth this
        # request's prefill alone.
        self.replicas = replicas
        self.num_copies = 0  # prefixes copied by the rule, for tests and metrics
        self.matched_blocks: dict[WorkerId, float] = {}  # of the last ``score`` call
        self.copied = False  # the last ``score`` call bought a copy

    def details(self, worker_id: WorkerId) -> dict[str, float]:
        """The chosen worker's cached prefix blocks past the skip, as the ``prefix_blocks``
        measure (the prefix scorer's unit), the best holder's, and whether the request was
        sent to copy a prefix (prefix_outcome.py), from the last ``score`` call."""
        details = {PREFIX_BLOCKS: self.matched_blocks.get(worker_id, 0.0),
                   BEST_PREFIX_BLOCKS: max(self.matched_blocks.values(), default=0.0)}  # fmt: skip
        if self.copied:
            details[PREFIX_COPY] = 1.0
        return details

    def best_prefix_blocks(self, request: RouteRequest, workers: Sequence[WorkerView]) -> float:
        """The most prompt blocks past the skip that any of ``workers`` holds (the pipeline
        asks for the workers its load gate left out)."""
        return best_held_blocks(self._index, request, workers)

    def score(self, request: RouteRequest, workers: Sequence[WorkerView]) -> dict[WorkerId, float]:
        seen: list[BlockHash] = []  # the blocks the match read: the copy rule's keys
        matched = self._index.match_prefix(_tap(request.block_hashes, seen),
                                           (w.worker_id for w in workers))  # fmt: skip
        skip = request.num_skip_blocks
        # Reported beside the time (``details``): the route header and placement read it.
        self.matched_blocks = {k: float(max(0, n - skip)) for k, n in matched.items()}
        size = request.block_size
        cached = {w.worker_id: max(matched[w.worker_id], skip) * size for w in workers}
        out = {w.worker_id: 0.0 - self._cost_s(w, request, cached[w.worker_id]) for w in workers}
        copy = self._copy_prefix(request, workers, matched, cached, out, seen)
        self.copied = copy is not None
        return out if copy is None else copy

    def _cost_s(self, worker: WorkerView, request: RouteRequest, num_cached_tokens: int) -> float:
        cost = worker_cost(worker, request.num_prompt_tokens, num_cached_tokens, self.costs,
                           self.decode_horizon_tokens, self.prefill_stall_weight)  # fmt: skip
        return cost.total_s

    def _copy_prefix(
        self,
        request: RouteRequest,
        workers: Sequence[WorkerView],
        matched: dict[WorkerId, int],
        cached: dict[WorkerId, int],
        scores: dict[WorkerId, float],
        seen: Sequence[BlockHash],
    ) -> dict[WorkerId, float] | None:
        """Rent or buy (replicas.py). The best worker's cached prefix costs this request
        ``rent``: the best worker's time over the pool's mean time had every worker held
        the prefix. A copy on the worker that would then be best costs ``price``: the
        prefill (and eviction) of what it lacks of the prefix. Returns the scores with
        the prefix counted as held everywhere (the copy's worker wins) when the ledger
        says buy, else None (the rent is recorded)."""
        if self.replicas is None or len(workers) < 2:
            return None
        best = max(scores, key=lambda w: scores[w])
        num_blocks = matched[best]
        if num_blocks <= request.num_skip_blocks:
            return None  # no prefix to use where it goes
        shared = cached[best]
        ideal = {w.worker_id: 0.0 - self._cost_s(w, request, max(cached[w.worker_id], shared))
                 for w in workers}  # fmt: skip
        target = max(ideal, key=lambda w: ideal[w])
        if target == best:
            return None  # the prefix is already where it is best used
        # Against the pool's mean, not the idlest worker: queues come and go, and a copy
        # made on one worker's dip would pay for noise that every placement pays (on the
        # shared-prefix comparison, 5 users a group, that copied most groups: hit rate
        # 0.52 against 0.64 at 40 req/s). What a copy saves for good is the holder's
        # excess over the typical worker. (Scores are minus seconds.)
        rent_s = sum(ideal.values()) / len(ideal) - scores[best]
        price_s = ideal[target] - scores[target]
        # The prefix's last block names it (each block hash chains those before it).
        if not self.replicas.should_copy(seen[num_blocks - 1], rent_s, price_s):
            return None
        self.num_copies += 1
        return ideal


def _tap(block_hashes: Iterable[BlockHash], seen: list[BlockHash]) -> Iterator[BlockHash]:
    """``block_hashes``, each also appended to ``seen`` as it is read (the match stops at
    the first block no candidate holds, so a lazy prompt is hashed no further)."""
    for block_hash in block_hashes:
        seen.append(block_hash)
        yield block_hash


class WaitGate:
    """The load gate in seconds: drop the workers whose queued prefill (``queued tokens x
    per_prefill_token_s``) is over ``(1 + slack_fraction) x`` the candidates' mean plus
    ``slack_s``, unless that drops them all. The time score already weighs a cache hit
    against the queue it would wait behind; the gate bounds what a stale load report or
    a wrong profile can pile on one worker."""

    name = "wait_gate"

    def __init__(self, costs: StepCosts, slack_fraction: float = 0.5, slack_s: float = 1.0) -> None:
        assert slack_fraction >= 0 and slack_s >= 0
        self.costs = costs
        self.slack_fraction = slack_fraction
        self.slack_s = slack_s

    def wait_s(self, worker: WorkerView) -> float:
        return worker.num_prefill_tokens * self.costs.timing.per_prefill_token_s

    def keep(self, workers: Sequence[WorkerView]) -> list[WorkerView]:
        if not workers:
            return []
        mean = sum(self.wait_s(w) for w in workers) / len(workers)
        limit = mean * (1.0 + self.slack_fraction) + self.slack_s
        under = [w for w in workers if self.wait_s(w) <= limit]
        return under or list(workers)


# -- work placed since the worker's last load report -----------------------------------------


# Per worker, at most this many placements are remembered past its last report (a worker
# whose reports stopped): then the oldest are forgotten, under-counting, never growing.
MAX_PLACED_PER_WORKER = 1024


class PlacedWork:
    """A worker's prompt tokens still to prefill, now: its last load report's, plus what
    this router sent it since (the report does not count that yet), drained at the
    worker's prefill rate (``PREFILL_DRAIN_FRACTION / per_prefill_token_s`` tokens a
    second, first come first served) from the report's time to now. Reports come every
    250 ms and a prompt of a few thousand tokens prefills in tens of ms, so without the
    drain a worker that was just sent work looks busy long after it is done (on the
    no-reuse control that put TTFT P50 70 % behind least-loaded's, which counts finished
    requests exactly).
    Pure: the caller passes the times (the clock of ``WorkerView.load_at_s``)."""

    def __init__(self, per_prefill_token_s: float) -> None:
        assert per_prefill_token_s > 0
        self._per_token_s = per_prefill_token_s / PREFILL_DRAIN_FRACTION
        # worker -> (placed at, prompt tokens to prefill there)
        self._placed: dict[WorkerId, deque[tuple[float, int]]] = {}

    def add(self, worker_id: WorkerId, now_s: float, num_tokens: int) -> None:
        placed = self._placed.setdefault(worker_id, deque(maxlen=MAX_PLACED_PER_WORKER))
        placed.append((now_s, num_tokens))

    def correct(self, worker: WorkerView, now_s: float) -> WorkerView:
        """``worker`` with ``num_prefill_tokens`` as of ``now_s``."""
        if worker.load_at_s is None:
            return worker  # no time to drain from: the report as it is
        placed = self._placed.get(worker.worker_id)
        while placed and placed[0][0] < worker.load_at_s:
            placed.popleft()  # the report counts it
        queued = float(worker.num_prefill_tokens)
        at_s = worker.load_at_s
        for placed_s, num_tokens in placed or ():
            queued = max(0.0, queued - (placed_s - at_s) / self._per_token_s) + num_tokens
            at_s = placed_s
        queued = max(0.0, queued - max(0.0, now_s - at_s) / self._per_token_s)
        tokens = math.ceil(queued)
        if tokens == worker.num_prefill_tokens:
            return worker
        return replace(worker, num_prefill_tokens=tokens)

    def forget(self, worker_id: WorkerId) -> None:
        self._placed.pop(worker_id, None)
