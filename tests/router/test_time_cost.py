"""The time-based scorer (routing/cost.py): a worker's score is the seconds the request
would cost there, and a cached block is worth the prefill time it saves, nothing more."""

from __future__ import annotations

import random

import pytest

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.proto.step_model import StepTiming
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import (
    DEFAULT_DECODE_HORIZON_TOKENS,
    DEFAULT_STEP_COSTS,
    PlacedWork,
    StepCosts,
    TimeCostScorer,
    WaitGate,
    worker_cost,
)
from kvflow.router.routing.pipeline import BLOCK_WEIGHTS, DEFAULT_WEIGHTS, build_pipeline
from kvflow.router.routing.placement import DisaggregationConfig, PlacementRequest, build_placement
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView

COSTS = DEFAULT_STEP_COSTS
SEED = make_hash_seed("m")
PROMPT_TOKENS = 7000
PROMPT = block_hashes(list(range(PROMPT_TOKENS)), block_size=16, seed=SEED)  # 437 blocks


def view(name: str, **kw: object) -> WorkerView:
    return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, 0, 0.0, **kw)  # type: ignore[arg-type]


def route(workers: list[WorkerView], index: BlockIndex) -> str:
    pipeline = build_pipeline(DEFAULT_WEIGHTS, index=index, sessions=SessionTable(),
                              rng=random.Random(0))  # fmt: skip
    request = RouteRequest("m", PROMPT, num_prompt_tokens=PROMPT_TOKENS, block_size=16)
    decision = pipeline.route(request, workers)
    assert decision is not None
    return decision.worker_id


def test_a_cached_prefix_is_worth_the_prefill_time_it_saves() -> None:
    idle = view("idle")
    cold = worker_cost(idle, PROMPT_TOKENS, 0, COSTS)
    warm = worker_cost(idle, PROMPT_TOKENS, 4096, COSTS)
    assert cold.total_s - warm.total_s == pytest.approx(4096 * COSTS.timing.per_prefill_token_s)
    # Queued prompt tokens cost the same per token as the request's own.
    queued = worker_cost(view("q", num_prefill_tokens=4096), PROMPT_TOKENS, 4096, COSTS)
    assert queued.total_s == pytest.approx(cold.total_s)


def test_decoding_neighbours_and_their_kv_cost_time() -> None:
    idle = worker_cost(view("a"), PROMPT_TOKENS, 0, COSTS)
    busy = worker_cost(view("b", num_decode_seqs=10, num_kv_tokens=70_000), PROMPT_TOKENS, 0,
                       COSTS)  # fmt: skip
    assert busy.own_decode_s > idle.own_decode_s == 0.0
    assert busy.stall_s > idle.stall_s == 0.0
    assert busy.own_ttft_s > idle.own_ttft_s


def test_a_prompt_past_the_free_kv_pays_for_what_it_evicts() -> None:
    roomy = worker_cost(view("a", kv_capacity_tokens=100_000), PROMPT_TOKENS, 0, COSTS)
    assert roomy.evict_s == 0.0
    full = worker_cost(view("b", kv_capacity_tokens=100_000, num_kv_tokens=96_000,
                            num_decode_seqs=1), PROMPT_TOKENS, 0, COSTS)  # fmt: skip
    short = PROMPT_TOKENS + DEFAULT_DECODE_HORIZON_TOKENS - 4000  # its prompt and horizon
    assert full.evict_s == pytest.approx(short * COSTS.timing.per_prefill_token_s)


def test_the_hit_wins_until_the_queue_there_costs_more_than_it_saves() -> None:
    index = BlockIndex()
    index.add(WorkerId("warm"), PROMPT[:256])  # 4,096 tokens: 0.11 s of prefill saved
    assert route([view("warm"), view("cold")], index) == "warm"
    # 2,000 tokens queued on the warm worker cost less than the 4,096 it saves...
    assert route([view("warm", num_prefill_tokens=2000), view("cold")], index) == "warm"
    # ... 6,000 cost more: the request goes where it starts sooner.
    assert route([view("warm", num_prefill_tokens=6000), view("cold")], index) == "cold"


def test_the_scorer_counts_blocks_past_the_skip_only() -> None:
    index = BlockIndex()
    index.add(WorkerId("a"), PROMPT[:100])
    scorer = TimeCostScorer(index, COSTS)
    skip = RouteRequest("m", PROMPT, num_skip_blocks=100, num_prompt_tokens=PROMPT_TOKENS)
    scores = scorer.score(skip, [view("a"), view("b")])
    assert scores[WorkerId("a")] == scores[WorkerId("b")]


def test_work_placed_since_the_report_counts_until_done_or_reported() -> None:
    per_token_s = 1e-3  # drained at half that rate: 500 tokens a second
    placed = PlacedWork(per_token_s)
    placed.add(WorkerId("a"), 10.0, 1000)
    reported = view("a", load_at_s=9.0, num_prefill_tokens=100)
    # At 10 s the report's 100 tokens are worked off; the 1,000 placed then are not.
    assert placed.correct(reported, 10.0).num_prefill_tokens == 1000
    # A second later half of them are.
    assert placed.correct(reported, 11.0).num_prefill_tokens == 500
    assert placed.correct(reported, 13.0).num_prefill_tokens == 0
    # A report taken after the placement counts it itself: the correction is dropped.
    later = view("a", load_at_s=10.5, num_prefill_tokens=800)
    assert placed.correct(later, 10.5).num_prefill_tokens == 800
    assert placed.correct(reported, 9.0).num_prefill_tokens == 100


def test_placement_spreads_a_burst_of_cold_prompts() -> None:
    """Without the correction the idlest worker by its last report stays the idlest until
    it reports again, and the whole burst would queue there."""
    index = BlockIndex()
    placement = build_placement(DEFAULT_WEIGHTS, DisaggregationConfig(), index=index,
                                sessions=SessionTable(), rng=random.Random(0))  # fmt: skip
    busy = {"num_decode_seqs": 1, "num_kv_tokens": 1000}  # a few ms more per step
    workers = [view("a", load_at_s=0.0)] + [view(n, load_at_s=0.0, **busy) for n in "bcd"]
    chosen = []
    for i in range(4):
        prompt = block_hashes([i + 1000] * PROMPT_TOKENS, block_size=16, seed=SEED)
        request = PlacementRequest("m", prompt, PROMPT_TOKENS, 16)
        plan = placement.plan(request, workers, now_s=1.0 + i * 0.01)
        assert plan is not None
        chosen.append(plan.stream_worker)
    assert sorted(chosen) == ["a", "b", "c", "d"]


def test_the_wait_gate_drops_a_backed_up_worker() -> None:
    gate = WaitGate(COSTS, slack_fraction=0.5, slack_s=1.0)
    tokens_3s = int(3.0 / COSTS.timing.per_prefill_token_s)  # mean 1 s: the line is 2.5 s
    kept = gate.keep([view("a", num_prefill_tokens=tokens_3s), view("b"), view("c")])
    assert [w.worker_id for w in kept] == ["b", "c"]
    assert len(gate.keep([view("a", num_prefill_tokens=tokens_3s)])) == 1


def test_step_costs_are_checked() -> None:
    with pytest.raises(ValueError):
        StepCosts(StepTiming(base_step_s=-1.0), 8192)
    with pytest.raises(ValueError):
        StepCosts(StepTiming(), 0)


def test_weights_written_for_the_block_policy_keep_it() -> None:
    from kvflow.router.settings import parse_config

    assert parse_config(None).weights == DEFAULT_WEIGHTS
    # What the operator renders from a CRD: the block policy's scorers, by name.
    crd = {"prefix_cache": 1.0, "queue_depth": 1.0, "kv_cache_usage": 0.0, "session": 8.0}
    assert parse_config({"routing": {"weights": crd}}).weights == crd
    # ... and by their earlier names, which read as the same scorers.
    old = {"prefix_blocks": 1.0, "queue_depth": 1.0, "kv_usage": 0.0, "session": 8.0}
    assert parse_config({"routing": {"weights": old}}).weights == crd
    # The time scorer weighted out beside a block weight: still the block policy.
    off = parse_config({"routing": {"weights": {"time_cost": 0, "kv_cache_usage": 1.0}}})
    assert off.weights == {**BLOCK_WEIGHTS, "time_cost": 0, "kv_cache_usage": 1.0}
    # Weighted in, it keeps the time-based default's weights under the block one's.
    on = parse_config({"routing": {"weights": {"time_cost": 2.0, "queue_depth": 0.5}}})
    assert on.weights == {**DEFAULT_WEIGHTS, "time_cost": 2.0, "queue_depth": 0.5}
    # Session alone tunes the time-based default.
    assert parse_config({"routing": {"weights": {"session": 0.05}}}).weights == {
        "time_cost": 1.0,
        "session": 0.05,
    }


def test_the_pool_passes_the_workers_load_in_tokens_to_routing() -> None:
    from kvflow.proto import worker_pb2 as pb
    from kvflow.proto.roles import Role
    from kvflow.router.workers.book import WorkerBook, WorkerFacts
    from kvflow.router.workers.convert import from_load_response

    book = WorkerBook()
    book.add(WorkerId("a"), WorkerFacts("m", Role.COLOCATED, True), is_healthy=True)
    assert book.views(0.0)[0].load_at_s is None  # no Load answer yet
    load = pb.LoadResponse(num_prefill_tokens=7000, num_decode_seqs=3, num_kv_tokens=9000,
                           num_total_blocks=100, num_cached_blocks=40)  # fmt: skip
    book.apply_report(WorkerId("a"), from_load_response(load, block_size=16), at_s=12.5)
    (got,) = book.views(12.5)
    assert (got.num_prefill_tokens, got.num_decode_seqs, got.num_kv_tokens) == (7000, 3, 9000)
    assert (got.kv_capacity_tokens, got.num_cached_tokens, got.load_at_s) == (1600, 640, 12.5)


def test_no_handoff_to_a_prefill_worker_whose_queue_outlasts_a_local_prefill() -> None:
    from kvflow.router.routing.placement import Colocated, Disaggregated, PlanReason

    def plan(prefill_tokens: int) -> object:
        placement = build_placement(DEFAULT_WEIGHTS, DisaggregationConfig(), index=BlockIndex(),
                                    sessions=SessionTable(), rng=random.Random(0))  # fmt: skip
        decode = WorkerView(WorkerId("d"), "m", Role.DECODE, True, 0, 0.0)
        prefill = WorkerView(WorkerId("p"), "m", Role.PREFILL, True, 1, 0.0,
                             num_prefill_tokens=prefill_tokens)  # fmt: skip
        return placement.plan(PlacementRequest("m", PROMPT, PROMPT_TOKENS, 16), [decode, prefill])

    assert isinstance(plan(0), Disaggregated)
    # One queued request, but 20,000 prompt tokens: longer than prefilling 7,000 locally.
    busy = plan(20_000)
    assert isinstance(busy, Colocated) and busy.reason is PlanReason.PREFILL_BUSY


def test_a_followers_claim_on_a_just_placed_prompt_is_its_whole_shared_prefix() -> None:
    """A prompt placed a moment ago is claimed for all of its prefix (up to a second of
    prefill), not its first 2,048 tokens: 0.2 s after the first, its worker has about 2,500
    of its 6,160 tokens still to prefill, so the follower starts there 0.1 s sooner than on
    the idle worker, which would compute the 6,000 shared tokens again."""
    index = BlockIndex()
    placement = build_placement(DEFAULT_WEIGHTS, DisaggregationConfig(), index=index,
                                sessions=SessionTable(), rng=random.Random(0))  # fmt: skip
    workers = [view("a", load_at_s=0.0), view("b", load_at_s=0.0)]
    shared = list(range(6000))

    def place(question: int, now_s: float) -> str:
        tokens = shared + [100_000 + question] * 160
        hashes = block_hashes(tokens, block_size=16, seed=SEED)
        plan = placement.plan(PlacementRequest("m", hashes, len(tokens), 16), workers, now_s)
        assert plan is not None
        return plan.stream_worker

    first = place(0, 0.0)
    assert place(1, 0.2) == first


def test_a_follow_up_stays_with_its_history_beside_a_few_decoding_neighbours() -> None:
    """A turn whose 3,000-token history is cached where 6 requests decode (81 ms of prefill
    saved) stays there rather than start cold on an idle worker: its decode beside them
    costs it and them 29 ms over the default decode horizon. At a 32-step horizon the same
    neighbours cost 110 ms and the turn left its history, prefilling it again elsewhere
    (the agent family's TTFT tail, docs/benchmarks.md)."""
    history = list(range(3000))
    tokens = history + [50_000] * 300
    hashes = block_hashes(tokens, block_size=16, seed=SEED)
    index = BlockIndex()
    index.add(WorkerId("home"), hashes[: len(history) // 16])
    pipeline = build_pipeline(DEFAULT_WEIGHTS, index=index, sessions=SessionTable(),
                              rng=random.Random(0))  # fmt: skip
    request = RouteRequest("m", hashes, num_prompt_tokens=len(tokens), block_size=16)
    home = view("home", num_decode_seqs=6, num_kv_tokens=42_000)
    decision = pipeline.route(request, [home, view("idle")])
    assert decision is not None and decision.worker_id == "home"


def test_a_prefill_stalls_each_decoding_neighbour_only_when_charged() -> None:
    """``prefill_stall_s``: the step that prefills the uncached tokens stalls every
    sequence decoding there for that long, at ``prefill_stall_weight`` per neighbour. Off
    by default (docs/benchmarks.md, "Routing comparison", "Tried and left off")."""
    per_token_s = COSTS.timing.per_prefill_token_s
    busy = view("b", num_decode_seqs=6, num_kv_tokens=42_000)
    assert worker_cost(busy, PROMPT_TOKENS, 0, COSTS).prefill_stall_s == 0.0
    off = worker_cost(busy, PROMPT_TOKENS, 0, COSTS, prefill_stall_weight=0.0)
    on = worker_cost(busy, PROMPT_TOKENS, 0, COSTS, prefill_stall_weight=0.5)
    assert on.prefill_stall_s == pytest.approx(0.5 * 6 * PROMPT_TOKENS * per_token_s)
    assert on.total_s == pytest.approx(off.total_s + on.prefill_stall_s)
    # Only the tokens it computes stall them; without neighbours nothing is stalled.
    warm = worker_cost(busy, PROMPT_TOKENS, 4096, COSTS, prefill_stall_weight=0.5)
    assert warm.prefill_stall_s == pytest.approx(0.5 * 6 * (PROMPT_TOKENS - 4096) * per_token_s)
    assert (
        worker_cost(view("a"), PROMPT_TOKENS, 0, COSTS, prefill_stall_weight=1.0).prefill_stall_s
        == 0.0
    )


def test_charged_prefill_stalls_send_a_cold_prompt_past_a_short_queue_to_spare_decodes() -> None:
    """Two short sequences decode on one worker, another has 1,000 prompt tokens queued
    (27 ms): uncharged, the prompt starts at once beside the two (15 ms of their decode and
    its own); charged at the full stall, waiting 27 ms spares them 190 ms each."""
    workers = [view("decoding", num_decode_seqs=2, num_kv_tokens=2000),
               view("queued", num_prefill_tokens=1000)]  # fmt: skip
    request = RouteRequest("m", PROMPT, num_prompt_tokens=PROMPT_TOKENS, block_size=16)

    def best(weight: float) -> str:
        scorer = TimeCostScorer(BlockIndex(), COSTS, prefill_stall_weight=weight)
        scores = scorer.score(request, workers)
        return max(scores, key=lambda w: scores[w])

    assert best(0.0) == "decoding"
    assert best(1.0) == "queued"
