"""Where a request went relative to its prompt's best holder (routing/prefix_outcome.py): the
decision's measures from the real pipeline and scorers, and the pure rule."""

from __future__ import annotations

import random

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import BLOCK_WEIGHTS, DEFAULT_WEIGHTS, build_pipeline
from kvflow.router.routing.prefix_outcome import PrefixOutcome, prefix_outcome
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import (
    BEST_PREFIX_BLOCKS,
    PREFIX_BLOCKS,
    PREFIX_COPY,
    RouteDecision,
    RouteRequest,
    WorkerId,
    WorkerView,
)

SEED = make_hash_seed("m")
PREAMBLE = list(range(4096))  # 256 blocks: 0.11 s of prefill at the default step costs


def view(name: str, **kw: object) -> WorkerView:
    return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, 0, 0.0, **kw)  # type: ignore[arg-type]


def routes(workers: list[WorkerView], index: BlockIndex, suffixes: range,
           weights: dict[str, float] = DEFAULT_WEIGHTS) -> list[RouteDecision]:  # fmt: skip
    pipeline = build_pipeline(weights, index=index, sessions=SessionTable(),
                              rng=random.Random(0))  # fmt: skip
    decisions = []
    for i in suffixes:
        tokens = PREAMBLE + [10_000 + i] * 800
        hashes = block_hashes(tokens, block_size=16, seed=SEED)
        request = RouteRequest("m", hashes, num_prompt_tokens=len(tokens), block_size=16)
        decision = pipeline.route(request, workers)
        assert decision is not None
        decisions.append(decision)
    return decisions


def holding_the_preamble() -> BlockIndex:
    index = BlockIndex()
    tokens = PREAMBLE + [10_000] * 800
    index.add(WorkerId("holder"), block_hashes(tokens, block_size=16, seed=SEED)[:256])
    return index


def test_a_request_on_its_holder_is_best_holder_and_one_held_nowhere_no_prefix() -> None:
    (decision,) = routes([view("holder"), view("other")], holding_the_preamble(), range(1, 2))
    assert decision.worker_id == "holder"
    assert decision.scores[PREFIX_BLOCKS] == decision.scores[BEST_PREFIX_BLOCKS] == 256
    assert prefix_outcome(decision.scores) is PrefixOutcome.BEST_HOLDER
    (cold,) = routes([view("holder"), view("other")], BlockIndex(), range(1, 2))
    assert cold.scores[BEST_PREFIX_BLOCKS] == 0
    assert prefix_outcome(cold.scores) is PrefixOutcome.NO_PREFIX


def test_a_holder_whose_queue_costs_more_than_the_hit_is_passed_over() -> None:
    # 6,000 tokens queued (0.16 s) on the holder against the 4,096 it would save (0.11 s).
    workers = [view("holder", num_prefill_tokens=6000), view("other")]
    (decision,) = routes(workers, holding_the_preamble(), range(1, 2))
    assert decision.worker_id == "other"
    assert (decision.scores[PREFIX_BLOCKS], decision.scores[BEST_PREFIX_BLOCKS]) == (0, 256)
    assert PREFIX_COPY not in decision.scores
    assert prefix_outcome(decision.scores) is PrefixOutcome.PASSED_OVER


def test_a_request_sent_to_copy_a_shared_prefix_is_a_copy() -> None:
    """As in test_replicas.py: the sixth request's rent buys a copy on the idle worker."""
    workers = [view("holder", num_prefill_tokens=1500), view("idle")]
    decisions = routes(workers, holding_the_preamble(), range(1, 8))
    outcomes = [prefix_outcome(d.scores) for d in decisions]
    assert [d.worker_id for d in decisions] == ["holder"] * 5 + ["idle", "holder"]
    assert outcomes == [PrefixOutcome.BEST_HOLDER] * 5 + [PrefixOutcome.COPY,
                                                          PrefixOutcome.BEST_HOLDER]  # fmt: skip
    assert decisions[5].scores[PREFIX_COPY] == 1
    assert PREFIX_COPY not in decisions[6].scores


def test_a_holder_the_load_gate_left_out_was_passed_over_not_missing() -> None:
    """The wait gate drops the holder (100,000 tokens queued, 2.7 s: over 1.5 x the mean plus 1 s)
    before any scorer sees it; the request still passed a holder over."""
    workers = [view("holder", num_prefill_tokens=100_000), view("other"), view("third")]
    (decision,) = routes(workers, holding_the_preamble(), range(1, 2))
    assert decision.num_candidates == 2 and decision.scores[PREFIX_BLOCKS] == 0
    assert decision.scores[BEST_PREFIX_BLOCKS] == 256
    assert prefix_outcome(decision.scores) is PrefixOutcome.PASSED_OVER


def test_the_block_policys_prefix_scorer_reports_the_best_holder_too() -> None:
    # 400 requests queued on the holder against its 256 cached blocks.
    workers = [WorkerView(WorkerId("holder"), "m", Role.COLOCATED, True, 400, 0.0),
               view("other")]  # fmt: skip
    (decision,) = routes(workers, holding_the_preamble(), range(1, 2), weights=BLOCK_WEIGHTS)
    assert decision.worker_id == "other"
    assert prefix_outcome(decision.scores) is PrefixOutcome.PASSED_OVER


def test_the_rule() -> None:
    assert prefix_outcome({}) is None  # the prefix scorers weighted out
    assert prefix_outcome({PREFIX_BLOCKS: 3.0}) is None
    assert prefix_outcome({PREFIX_BLOCKS: 0.0, BEST_PREFIX_BLOCKS: 0.0}) is PrefixOutcome.NO_PREFIX
    assert (
        prefix_outcome({PREFIX_BLOCKS: 5.0, BEST_PREFIX_BLOCKS: 5.0}) is PrefixOutcome.BEST_HOLDER
    )
    assert (
        prefix_outcome({PREFIX_BLOCKS: 2.0, BEST_PREFIX_BLOCKS: 5.0}) is PrefixOutcome.PASSED_OVER
    )
    # Sent to copy, but another scorer's weight kept it on the best holder: it hit.
    copy = {PREFIX_BLOCKS: 5.0, BEST_PREFIX_BLOCKS: 5.0, PREFIX_COPY: 1.0}
    assert prefix_outcome(copy) is PrefixOutcome.BEST_HOLDER
    assert prefix_outcome({**copy, PREFIX_BLOCKS: 0.0}) is PrefixOutcome.COPY
