"""Placement, table-driven: the decision rule, the tokens a decode worker lacks, and the
plan for pools of every shape (colocated, disaggregated, decode only, busy prefill)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import BLOCK_WEIGHTS
from kvflow.router.routing.placement import (
    Colocated,
    Disaggregated,
    DisaggregationConfig,
    PlacementRequest,
    PlanReason,
    build_placement,
    decide,
    missing_prompt_tokens,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId, WorkerView

BOTH, PREFILL, DECODE = Role.COLOCATED, Role.PREFILL, Role.DECODE
CONFIG = DisaggregationConfig()  # min 512 tokens, prefill queue below 8
TOKENS = list(range(640))  # 40 blocks; 39 can be sent (the last token is always local)
PROMPT = block_hashes(TOKENS, block_size=16, seed=make_hash_seed("m"))


@pytest.mark.parametrize(
    ("num_missing", "min_queue", "config", "expected"),
    [
        (511, 0, CONFIG, PlanReason.FEW_MISSING_TOKENS),
        (512, 0, CONFIG, PlanReason.MANY_MISSING_TOKENS),
        (512, 7, CONFIG, PlanReason.MANY_MISSING_TOKENS),
        (512, 8, CONFIG, PlanReason.PREFILL_BUSY),
        (4096, 30, CONFIG, PlanReason.PREFILL_BUSY),
        (16, 0, replace(CONFIG, min_remote_prefill_tokens=0), PlanReason.MANY_MISSING_TOKENS),
        (0, 0, replace(CONFIG, min_remote_prefill_tokens=0), PlanReason.FEW_MISSING_TOKENS),
        (4096, 0, replace(CONFIG, max_prefill_queue_depth=0), PlanReason.PREFILL_BUSY),
    ],
)
def test_decide(num_missing: int, min_queue: int, config, expected: PlanReason) -> None:  # type: ignore[no-untyped-def]
    assert decide(num_missing, min_queue, config) is expected


@pytest.mark.parametrize(
    ("num_prompt", "num_cached_blocks", "expected"),
    [
        (1, 0, 0),
        (16, 0, 0),  # one block, but it holds the last token
        (17, 0, 16),
        (32, 0, 16),
        (33, 0, 32),
        (33, 1, 16),
        (33, 2, 0),
        (33, 5, 0),  # a stale index claims more than the prompt has
        (640, 20, 304),
    ],
)
def test_missing_prompt_tokens(num_prompt: int, num_cached_blocks: int, expected: int) -> None:
    assert missing_prompt_tokens(num_prompt, 16, num_cached_blocks) == expected


def view(name: str, role: Role, queue: int = 0, healthy: bool = True) -> WorkerView:
    return WorkerView(WorkerId(name), "m", role, healthy, queue, 0.0)


def plan_for(
    workers: list[WorkerView],
    cached: dict[str, int] | None = None,
    config: DisaggregationConfig = CONFIG,
    weights=BLOCK_WEIGHTS,  # type: ignore[no-untyped-def]
    excluded: frozenset[str] = frozenset(),
):  # type: ignore[no-untyped-def]
    index = BlockIndex()
    for name, num_blocks in (cached or {}).items():
        index.add(WorkerId(name), PROMPT[:num_blocks])
    placement = build_placement(weights, config, index=index, sessions=SessionTable(),
                                rng=random.Random(0))  # fmt: skip
    request = PlacementRequest("m", PROMPT, len(TOKENS), 16,
                               excluded=frozenset(WorkerId(w) for w in excluded))  # fmt: skip
    return placement.plan(request, workers)


def shape(plan) -> tuple[str, ...] | None:  # type: ignore[no-untyped-def]
    if plan is None:
        return None
    if isinstance(plan, Colocated):
        return ("colocated", plan.worker.worker_id, plan.reason.value)
    assert isinstance(plan, Disaggregated)
    return (plan.prefill.worker_id, plan.decode.worker_id, plan.reason.value)


PD_POOL = [view("p1", PREFILL), view("p2", PREFILL, queue=1), view("d1", DECODE),
           view("d2", DECODE, queue=1)]  # fmt: skip


@pytest.mark.parametrize(
    ("workers", "kw", "expected"),
    [
        # A colocated pool: as before disaggregation existed.
        ([view("a", BOTH), view("b", BOTH, queue=1)], {}, ("colocated", "a", "colocated_worker")),
        # Nothing cached anywhere: decode lacks 624 tokens, the idlest of each role serves.
        (PD_POOL, {}, ("p1", "d1", "many_missing_tokens")),
        # d2 caches 30 blocks (30 - 1 beats 0 - 0) and lacks only 144 tokens: it prefills.
        (PD_POOL, {"cached": {"d2": 30}}, ("colocated", "d2", "few_missing_tokens")),
        # d2 caches 5 blocks and still lacks 544 tokens: shipped.
        (PD_POOL, {"cached": {"d2": 5}}, ("p1", "d2", "many_missing_tokens")),
        # Prefill workers are scored by what decode lacks: p1's 5 blocks are all on d2 too,
        # p2's 20 reach 15 past them (15 - 1 queued beats 0).
        (PD_POOL, {"cached": {"d2": 5, "p1": 5, "p2": 20}}, ("p2", "d2", "many_missing_tokens")),
        # The least-loaded prefill worker has 8 requests: decode prefills itself.
        (
            [view("p1", PREFILL, queue=8), view("p2", PREFILL, queue=9), view("d1", DECODE)],
            {},
            ("colocated", "d1", "prefill_busy"),
        ),
        # ... but one idle enough is all it takes.
        (
            [view("p1", PREFILL, queue=20), view("p2", PREFILL, queue=7), view("d1", DECODE)],
            {},
            ("p2", "d1", "many_missing_tokens"),
        ),
        # A pool of decode workers only still serves.
        (
            [view("d1", DECODE), view("d2", DECODE, queue=2)],
            {},
            ("colocated", "d1", "no_prefill_worker"),
        ),
        (
            [view("p1", PREFILL, healthy=False), view("d1", DECODE)],
            {},
            ("colocated", "d1", "no_prefill_worker"),
        ),
        (PD_POOL, {"excluded": frozenset({"p1", "p2"})}, ("colocated", "d1", "no_prefill_worker")),
        (PD_POOL, {"excluded": frozenset({"d1"})}, ("p1", "d2", "many_missing_tokens")),
        (PD_POOL, {"config": replace(CONFIG, enabled=False)}, ("colocated", "d1", "disabled")),
        # A `colocated` worker scored above the decode workers serves colocated.
        (
            [*PD_POOL, view("b1", BOTH)],
            {"cached": {"b1": 4}},
            ("colocated", "b1", "colocated_worker"),
        ),
        # No worker that can stream tokens: no plan (a 503).
        ([view("p1", PREFILL)], {}, None),
        (PD_POOL, {"excluded": frozenset({"d1", "d2"})}, None),
    ],
)
def test_plan(workers: list[WorkerView], kw: dict, expected: tuple[str, ...] | None) -> None:  # type: ignore[type-arg]
    assert shape(plan_for(workers, **kw)) == expected


def test_missing_tokens_come_from_the_index_when_the_prefix_scorer_is_off() -> None:
    weights = {"queue_depth": 1.0}
    workers = [view("p1", PREFILL), view("d1", DECODE)]
    assert shape(plan_for(workers, {"d1": 30}, weights=weights)) == (
        "colocated", "d1", "few_missing_tokens",
    )  # fmt: skip
    plan = plan_for(workers, {"d1": 5}, weights=weights)
    assert isinstance(plan, Disaggregated) and plan.num_missing_tokens == 544


def test_route_header_names_both_workers_and_why() -> None:
    plan = plan_for(PD_POOL, {"d2": 5, "p1": 7})
    assert isinstance(plan, Disaggregated)
    assert plan.header_value() == (
        "prefill=p1 decode=d2; plan=disaggregated; reason=many_missing_tokens; "
        "missing_tokens=544; score=4; prefix_cache=5; queue_depth=-1; "
        "session=0; prefix_blocks=5; best_prefix_blocks=5; candidates=2; prefill_score=2; "
        "prefill_prefix_cache=2; prefill_queue_depth=0; prefill_prefix_blocks=2; "
        "prefill_best_prefix_blocks=2; prefill_candidates=2"
    )
    colocated = plan_for([view("a", BOTH)])
    assert colocated is not None and colocated.header_value() == (
        "worker=a; plan=colocated; reason=colocated_worker; score=0; prefix_cache=0; "
        "queue_depth=0; session=0; prefix_blocks=0; best_prefix_blocks=0; candidates=1"
    )
