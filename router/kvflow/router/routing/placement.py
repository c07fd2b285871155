"""Placement: where one choice of a request runs, as an execution plan. Pure: no I/O.

1. The decode profile (`colocated` and `decode` workers, scored as configured: by default the
   seconds the request would cost there, routing/cost.py) picks the worker that streams
   tokens. The views are first corrected by the prompt tokens placed since each worker's
   last load report (`PlacedWork`).
2. A `colocated` worker serves the request itself. A `decode` worker gets a prefill worker
   only when that pays (`decide`): it lacks at least `min_remote_prefill_tokens` of the prompt, the
   least-loaded prefill worker has fewer than `max_prefill_queue_depth` requests, and its
   queued prefill takes no longer than the decode worker's own prefill of the prompt.
   Otherwise it prefills itself.
3. The prefill profile (`prefill` workers) scores each by the same scorers, crediting its
   cached blocks only past what the decode worker holds.

A plan names its workers and why; serving/ carries it out. A retry asks for a new plan with
the failed workers excluded; a plan is never patched.

4. Given the time, placement remembers the first blocks of each prompt it places on the
   workers of the plan, and the index counts them as held there until those workers' KV
   events confirm them or ``in_flight_ttl_s`` passes (in_flight.py): a burst of requests on
   a new prefix then follows its first request instead of scattering.
"""

from __future__ import annotations

import enum
import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvflow.proto.block_hash import BlockHash
from kvflow.proto.roles import Role
from kvflow.router.routing.block_hasher import PromptHashes
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS, PlacedWork, StepCosts
from kvflow.router.routing.pipeline import (
    DEFAULT_WAIT_GATE_SLACK_S,
    SERVING_ROLES,
    RoutingPipeline,
    build_pipeline,
)
from kvflow.router.routing.prefix_outcome import PrefixOutcome, prefix_outcome
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import (
    PREFIX_BLOCKS,
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerView,
)

# Measured on real workers (docs/benchmarks.md, "The threshold"): on an idle prefill +
# decode pair the handoff adds 34-137 ms to prompts of 64-256 tokens (+9-37 % TTFT) and
# nothing measurable from 512 tokens (-1 to +2 %), where it spares the decode worker
# 1.5-3.5 s of compute its running streams would wait through. llm-d's simulator saw short
# chat turns lose 2-3x TTFT when disaggregated; always-PD here cost them 2.4-5x.
DEFAULT_MIN_REMOTE_PREFILL_TOKENS = 512
# A prefill worker with 8 prompts queued or running keeps a new one waiting for about 8
# prefills; the decode worker, chunking the prompt in with its decodes, is then sooner.
DEFAULT_MAX_PREFILL_QUEUE_DEPTH = 8
# Long enough for a queued long prefill: with 10 s, 14 of 24 shipped 600-1,500-token
# prompts on CPU workers fell back to a local prefill after waiting the whole timeout (and
# did worse than never shipped); with 30 s, 3 of 26 did. An 8k-token Llama-3-8B prompt is
# 1 GiB of KV, about 1 s over 10 Gb/s. Still well under a client's usual 60 s timeout.
DEFAULT_TRANSFER_TIMEOUT_S = 30.0

# How long a placed prompt's blocks count as held by its worker before that worker's KV
# events confirm them. Confirmation normally comes a prefill after the placement (0.2 s for
# 6,000 tokens on an H100; more behind a queue); the TTL only bounds what a request that
# never stores its blocks (failed, cancelled, a worker without a prefix cache) can claim.
# On the routing comparison's hot-prefix workload 1, 2, 5, 10 and 30 s all gave the same
# placements (docs/router.md, "Routing"); 5 s covers a prompt queued a few seconds.
DEFAULT_IN_FLIGHT_TTL_S = 5.0
# Of each placed prompt, the leading tokens remembered: as many as the load gate's slack
# of prefill time (``DEFAULT_WAIT_GATE_SLACK_S``, 1 s: 36,900 tokens at the default step
# costs). The time scorer values a claim at the prefill it saves, so a claim cut short
# under-values the prefix by what was cut: with 2,048 tokens remembered, a follower of a
# 17K-token prompt placed 0.1 s before saw 55 ms of hit where 0.46 s was coming and
# prefilled the whole prefix elsewhere; on the Mooncake trace at 4x that lost 0.27 of the
# ideal's hit rate (docs/benchmarks.md). Past the slack a claim outweighs any queue the gate
# lets through, so remembering more changes no choice; a cold prompt costs at most its
# hashes up to there (about 4 us a block: 2 ms for an 8K-token prompt, 9 ms at the cap).
# Never more than the prompt holds, so it can only under-claim.
IN_FLIGHT_PREFILL_S = DEFAULT_WAIT_GATE_SLACK_S


def max_in_flight_blocks(costs: StepCosts, block_size: int) -> int:
    """Of a placed prompt, the leading blocks remembered: ``IN_FLIGHT_PREFILL_S`` of
    prefill at ``costs``."""
    num_tokens = IN_FLIGHT_PREFILL_S / max(costs.timing.per_prefill_token_s, 1e-9)
    return max(1, math.ceil(num_tokens / block_size))


# At the default step costs and 16-token blocks: 2,307 blocks.
MAX_IN_FLIGHT_BLOCKS = max_in_flight_blocks(DEFAULT_STEP_COSTS, 16)

PREFILL_ROLES = frozenset({Role.PREFILL})


@dataclass(frozen=True)
class DisaggregationConfig:
    """The router's `disaggregation:` section."""

    enabled: bool = True
    min_remote_prefill_tokens: int = DEFAULT_MIN_REMOTE_PREFILL_TOKENS
    max_prefill_queue_depth: int = DEFAULT_MAX_PREFILL_QUEUE_DEPTH
    # The longest wait for each handoff step: the decode worker's reservation, the prefill
    # worker's Prefill call, and the decode worker's own wait for the blocks.
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S


class PlanReason(enum.Enum):
    """Why a plan has the shape it has (a bounded metric label)."""

    COLOCATED_WORKER = "colocated_worker"  # the best worker is a `colocated` worker
    DISABLED = "disabled"  # disaggregation.enabled is false
    NO_PREFILL_WORKER = "no_prefill_worker"  # none healthy, or all failed this request
    FEW_MISSING_TOKENS = "few_missing_tokens"  # decode lacks too little to be worth shipping
    PREFILL_BUSY = "prefill_busy"  # even the least-loaded prefill worker is backed up
    MANY_MISSING_TOKENS = "many_missing_tokens"  # disaggregated: it pays


def missing_prompt_tokens(num_prompt_tokens: int, block_size: int, num_cached_blocks: int) -> int:
    """Prompt tokens a prefill worker could send that the decode worker lacks: whole blocks
    that end before the last prompt token (the decode worker always computes that one
    itself, KV_HANDOFF_VERSION_1), past the ones it caches."""
    num_sendable_blocks = (num_prompt_tokens - 1) // block_size
    return max(0, num_sendable_blocks - num_cached_blocks) * block_size


def decide(
    num_missing_tokens: int,
    min_prefill_queue_depth: int,
    config: DisaggregationConfig,
    *,
    prefill_wait_s: float = 0.0,
    local_prefill_s: float = math.inf,
) -> PlanReason:
    """Whether a decode worker that lacks ``num_missing_tokens`` gets a prefill worker, when
    the least-loaded prefill worker has ``min_prefill_queue_depth`` requests.

    With the time model (routing/cost.py): also not when the least-busy prefill worker's
    queued prefill (``prefill_wait_s``) takes longer than the decode worker would take to
    prefill the prompt itself, its own queue included (``local_prefill_s``): the handoff
    would only add that wait. Workers that report no load in tokens have no wait, so
    there the request count alone decides, as before."""
    if num_missing_tokens == 0 or num_missing_tokens < config.min_remote_prefill_tokens:
        return PlanReason.FEW_MISSING_TOKENS  # (nothing to send is never worth a handoff)
    if min_prefill_queue_depth >= config.max_prefill_queue_depth:
        return PlanReason.PREFILL_BUSY
    if prefill_wait_s > local_prefill_s:
        return PlanReason.PREFILL_BUSY
    return PlanReason.MANY_MISSING_TOKENS


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
        return self.worker.scores.get(PREFIX_BLOCKS, 0.0)

    @property
    def prefix_outcome(self) -> PrefixOutcome | None:
        """Where it went relative to its prompt's best holder (prefix_outcome.py)."""
        return prefix_outcome(self.worker.scores)

    def header_value(self) -> str:
        return "; ".join([f"worker={self.worker.worker_id}", f"plan={self.decision}",
                          f"reason={self.reason.value}", *self.worker.explain()])  # fmt: skip


@dataclass(frozen=True)
class Disaggregated:
    """A prefill worker computes what the decode worker lacks and ships its KV there; the
    decode worker streams the tokens."""

    prefill: RouteDecision
    decode: RouteDecision
    reason: PlanReason
    num_missing_tokens: int  # the router's estimate; the decode worker's reservation decides
    decision = "disaggregated"

    @property
    def stream_worker(self) -> WorkerId:
        return self.decode.worker_id

    @property
    def matched_blocks(self) -> float:
        return self.decode.scores.get(PREFIX_BLOCKS, 0.0)

    @property
    def prefix_outcome(self) -> PrefixOutcome | None:
        """The decode worker's, which keeps the prompt's KV for its next turn."""
        return prefix_outcome(self.decode.scores)

    def header_value(self) -> str:
        return "; ".join([f"prefill={self.prefill.worker_id} decode={self.decode.worker_id}",
                          f"plan={self.decision}", f"reason={self.reason.value}",
                          f"missing_tokens={self.num_missing_tokens}", *self.decode.explain(),
                          *self.prefill.explain("prefill_")])  # fmt: skip


ExecutionPlan = Colocated | Disaggregated


class Placement:
    def __init__(
        self,
        decode: RoutingPipeline,
        prefill: RoutingPipeline,
        index: BlockIndex,
        config: DisaggregationConfig,
        in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
        costs: StepCosts = DEFAULT_STEP_COSTS,
    ) -> None:
        assert in_flight_ttl_s >= 0
        self._decode = decode
        self._prefill = prefill
        self._index = index
        self.config = config
        self.in_flight_ttl_s = in_flight_ttl_s  # 0: remember nothing
        self._costs = costs
        self._placed = PlacedWork(costs.timing.per_prefill_token_s)

    def plan(
        self,
        request: PlacementRequest,
        workers: Sequence[WorkerView],
        now_s: float | None = None,
    ) -> ExecutionPlan | None:
        """The plan for ``request``, or None when no worker can stream it.

        ``now_s`` (seconds on a clock that does not go back): what was placed before counts
        until its TTL, and this plan's prompt is remembered on its workers. Without it,
        routing sees the KV events' view alone and remembers nothing.
        """
        if now_s is not None:
            self._index.expire_in_flight(now_s)
            workers = [self._placed.correct(w, now_s) for w in workers]
        plan = self._plan(request, workers)
        if plan is not None and now_s is not None:
            self._add_placed(plan, request, now_s)
            if self.in_flight_ttl_s > 0:
                caching = {w.worker_id for w in workers if w.caches_prefixes}
                self._remember(plan, request, now_s + self.in_flight_ttl_s, caching)
        return plan

    def _add_placed(self, plan: ExecutionPlan, request: PlacementRequest, now_s: float) -> None:
        """The prompt tokens the plan's prefilling worker will compute, until that worker's
        next load report counts them (the time scorer's queued prefill)."""
        if isinstance(plan, Disaggregated):
            prefill_id, num_tokens = plan.prefill.worker_id, plan.num_missing_tokens
        else:
            prefill_id = plan.worker.worker_id
            num_cached = self._num_cached_blocks(plan.worker, request) * request.block_size
            num_tokens = max(1, request.num_prompt_tokens - num_cached)
        self._placed.add(prefill_id, now_s, num_tokens)

    def forget(
        self, plan: ExecutionPlan, request: PlacementRequest, failed: Iterable[WorkerId]
    ) -> None:
        """The plan failed on ``failed``: what it sent there will not be stored, so it no
        longer draws the prompt's followers to a worker that refused or lost it."""
        leading = self._leading_blocks(request)
        for worker_id in set(failed) & set(_plan_workers(plan)):
            self._index.drop_in_flight(worker_id, leading)

    def _remember(
        self,
        plan: ExecutionPlan,
        request: PlacementRequest,
        until_s: float,
        caching: set[WorkerId],
    ) -> None:
        """The prompt's leading blocks are on their way to the plan's workers: a
        disaggregated plan's prefill worker computes them (from its own cache) and keeps
        them, and its decode worker receives or computes them. A worker without a prefix
        cache keeps nothing and would never confirm it: it is skipped."""
        workers = [w for w in _plan_workers(plan) if w in caching]
        if not workers:
            return
        leading = self._leading_blocks(request)
        for worker_id in workers:
            self._index.add_in_flight(worker_id, leading, until_s)

    def _leading_blocks(self, request: PlacementRequest) -> list[BlockHash]:
        """The prompt's first ``max_in_flight_blocks`` block hashes (hashing them if not
        yet)."""
        hashes = request.block_hashes
        blocks = hashes.peek() if isinstance(hashes, PromptHashes) else iter(hashes)
        limit = max_in_flight_blocks(self._costs, request.block_size)
        return list(itertools.islice(blocks, limit))

    def _plan(
        self, request: PlacementRequest, workers: Sequence[WorkerView]
    ) -> ExecutionPlan | None:
        route = RouteRequest(
            request.model, request.block_hashes, request.session_id, request.excluded,
            num_prompt_tokens=request.num_prompt_tokens, block_size=request.block_size,
        )  # fmt: skip
        decode = self._decode.route(route, workers)
        if decode is None:
            return None
        if decode.role is not Role.DECODE:
            return Colocated(decode, PlanReason.COLOCATED_WORKER)
        if not self.config.enabled:
            return Colocated(decode, PlanReason.DISABLED)
        prefill_candidates = self._prefill.candidates(route, workers)
        if not prefill_candidates:
            return Colocated(decode, PlanReason.NO_PREFILL_WORKER)
        num_cached_blocks = self._num_cached_blocks(decode, request)
        num_missing = missing_prompt_tokens(
            request.num_prompt_tokens, request.block_size, num_cached_blocks
        )
        min_queue_depth = min(w.queue_depth for w in prefill_candidates)
        per_token_s = self._costs.timing.per_prefill_token_s
        prefill_wait_s = min(w.num_prefill_tokens for w in prefill_candidates) * per_token_s
        decode_view = next(w for w in workers if w.worker_id == decode.worker_id)
        local_prefill_s = (decode_view.num_prefill_tokens + num_missing) * per_token_s
        reason = decide(num_missing, min_queue_depth, self.config,
                        prefill_wait_s=prefill_wait_s, local_prefill_s=local_prefill_s)  # fmt: skip
        if reason is not PlanReason.MANY_MISSING_TOKENS:
            return Colocated(decode, reason)
        prefill = self._prefill.route(
            replace(route, num_skip_blocks=num_cached_blocks), prefill_candidates
        )
        assert prefill is not None, "the candidates passed the same filters"
        return Disaggregated(prefill, decode, reason, num_missing)

    def _num_cached_blocks(self, decode: RouteDecision, request: PlacementRequest) -> int:
        """The decode worker's cached prefix blocks: the scorer's count, or the index's
        when the prefix scorer is weighted out."""
        scored = decode.scores.get(PREFIX_BLOCKS)
        if scored is not None:
            return int(scored)
        matched = self._index.match_prefix(request.block_hashes, [decode.worker_id])
        return matched[decode.worker_id]


def _plan_workers(plan: ExecutionPlan) -> list[WorkerId]:
    if isinstance(plan, Disaggregated):
        return [plan.stream_worker, plan.prefill.worker_id]
    return [plan.stream_worker]


def build_placement(
    weights: Mapping[str, float],
    config: DisaggregationConfig,
    *,
    index: BlockIndex,
    sessions: SessionTable,
    rng: random.Random,
    in_flight_ttl_s: float = DEFAULT_IN_FLIGHT_TTL_S,
    costs: StepCosts = DEFAULT_STEP_COSTS,
) -> Placement:
    """The decode profile with every configured scorer; the prefill profile without
    session affinity (a conversation returns to its decode worker, where its KV lives).
    ``costs``: the workers' step-time model (the time scorer's)."""
    decode = build_pipeline(weights, index=index, sessions=sessions, rng=rng,
                            roles=SERVING_ROLES, costs=costs)  # fmt: skip
    prefill_weights = {name: w for name, w in weights.items() if name != "session"}
    prefill = build_pipeline(prefill_weights, index=index, sessions=sessions, rng=rng,
                             roles=PREFILL_ROLES, costs=costs)  # fmt: skip
    return Placement(decode, prefill, index, config, in_flight_ttl_s, costs)
