"""The routing pipeline, table-driven: filters, each scorer, weights, ties, failover."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS
from kvflow.router.routing.pipeline import (
    BLOCK_WEIGHTS,
    SCORER_ALIASES,
    SCORERS,
    SERVING_ROLES,
    RoutingConfigError,
    ScorerInputs,
    build_pipeline,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView

SEED = make_hash_seed("m")
PROMPT = block_hashes(list(range(160)), block_size=16, seed=SEED)  # 10 blocks


def worker(
    name: str,
    *,
    queue: int = 0,
    kv: float = 0.0,
    healthy: bool = True,
    model: str = "m",
    role: Role = Role.COLOCATED,
) -> WorkerView:
    return WorkerView(WorkerId(name), model, role, healthy, queue, kv)


def make(weights=BLOCK_WEIGHTS, seed: int = 0, roles=SERVING_ROLES):  # type: ignore[no-untyped-def]
    index, sessions = BlockIndex(), SessionTable()
    pipeline = build_pipeline(
        weights, index=index, sessions=sessions, rng=random.Random(seed), roles=roles
    )
    return pipeline, index, sessions


def request(**kw) -> RouteRequest:  # type: ignore[no-untyped-def]
    return RouteRequest(model="m", block_hashes=PROMPT, **kw)


def test_default_score_is_cached_blocks_minus_queue_depth() -> None:
    pipeline, index, _ = make({"prefix_cache": 1.0, "queue_depth": 1.0})
    index.add(WorkerId("a"), PROMPT[:6])
    index.add(WorkerId("b"), PROMPT[:2])
    # a: 6 - 5 = 1; b: 2 - 0 = 2; c: 0 - 1 = -1
    workers = [worker("a", queue=5), worker("b"), worker("c", queue=1)]
    decision = pipeline.route(request(), workers)
    assert decision is not None
    assert decision.worker_id == "b"
    assert decision.score == 2.0
    # Each scorer's value, then the measures the prefix scorer reports beside it: the
    # chosen worker's cached blocks and the best holder's (a, passed over for its queue).
    assert decision.scores == {"prefix_cache": 2.0, "queue_depth": 0.0, "prefix_blocks": 2.0,
                               "best_prefix_blocks": 6.0}  # fmt: skip
    assert decision.num_candidates == 3
    # One more queued request on b tips it to a (6 - 5 = 1 > 2 - 2 = 0).
    workers[1] = worker("b", queue=2)
    assert pipeline.route(request(), workers).worker_id == "a"  # type: ignore[union-attr]


PREFILL_ONLY = frozenset({Role.PREFILL})
EXCLUDE_A = {"excluded": frozenset({WorkerId("a")})}


@pytest.mark.parametrize(
    ("workers", "kw", "roles", "expected"),
    [
        ([worker("a", healthy=False), worker("b", queue=9)], {}, SERVING_ROLES, "b"),
        ([worker("a", model="other"), worker("b", queue=9)], {}, SERVING_ROLES, "b"),
        ([worker("a", role=Role.PREFILL), worker("b", queue=9)], {}, SERVING_ROLES, "b"),
        ([worker("a", role=Role.DECODE), worker("b", queue=9)], {}, SERVING_ROLES, "a"),
        ([worker("a"), worker("b", queue=9)], EXCLUDE_A, SERVING_ROLES, "b"),
        ([worker("a", role=Role.PREFILL, queue=9), worker("b")], {}, PREFILL_ONLY, "a"),
        ([worker("a", healthy=False)], {}, SERVING_ROLES, None),
        ([], {}, SERVING_ROLES, None),
    ],
)
def test_filters(workers, kw, roles, expected) -> None:
    pipeline, _, _ = make(roles=roles)
    decision = pipeline.route(request(**kw), workers)
    assert (decision.worker_id if decision else None) == expected


def test_skipped_blocks_do_not_count_for_the_prefix_scorer() -> None:
    # A prefill worker is worth only the blocks the decode worker lacks.
    pipeline, index, _ = make({"prefix_cache": 1.0}, roles=PREFILL_ONLY)
    index.add(WorkerId("a"), PROMPT[:6])
    index.add(WorkerId("b"), PROMPT[:3])
    workers = [worker(n, role=Role.PREFILL) for n in "ab"]
    for num_skip, best, expected in [(0, "a", [6.0, 3.0]), (4, "a", [2.0, 0.0])]:
        decision = pipeline.route(request(num_skip_blocks=num_skip), workers)
        assert decision is not None and decision.worker_id == best
        each = [pipeline.route(request(num_skip_blocks=num_skip), [w]) for w in workers]
        assert [d.score for d in each if d] == expected
    # Decode holds more than any prefill worker: none is worth anything (never negative).
    each = [pipeline.route(request(num_skip_blocks=8), [w]) for w in workers]
    assert [d.score for d in each if d] == [0.0, 0.0]


# The KV-usage scorer is off by default; the gateway's configuration can weigh it in.
WITH_KV_USAGE = {**BLOCK_WEIGHTS, "kv_cache_usage": 2.0}


def test_kv_usage_scorer_prefers_the_emptier_cache() -> None:
    pipeline, _, _ = make(WITH_KV_USAGE)
    decision = pipeline.route(request(), [worker("a", kv=0.9), worker("b", kv=0.2)])
    assert decision is not None and decision.worker_id == "b"
    assert decision.scores["kv_cache_usage"] == -0.2


def test_session_affinity_outweighs_small_load_differences_only() -> None:
    pipeline, _, sessions = make()
    sessions.set("s1", WorkerId("a"))
    workers = [worker("a", queue=3), worker("b")]
    assert pipeline.route(request(session_id="s1"), workers).worker_id == "a"  # type: ignore[union-attr]
    workers = [worker("a", queue=20), worker("b")]
    assert pipeline.route(request(session_id="s1"), workers).worker_id == "b"  # type: ignore[union-attr]
    assert (
        pipeline.route(request(session_id="other"), [worker("a", queue=3), worker("b")]).worker_id
        == "b"
    )  # type: ignore[union-attr]


def test_ties_go_to_the_worker_chosen_least_recently() -> None:
    pipeline, _, _ = make(seed=3)
    workers = [worker(name) for name in "abcd"]
    picks = [pipeline.route(request(), workers).worker_id for _ in range(12)]  # type: ignore[union-attr]
    # Every round of four gives each worker one request, in an order the seed draws.
    for start in range(0, 12, 4):
        assert sorted(picks[start : start + 4]) == list("abcd")
    # A worker that joins is the least recently chosen of all: it takes the next one.
    assert pipeline.route(request(), [*workers, worker("e")]).worker_id == "e"  # type: ignore[union-attr]


def test_scores_within_half_a_point_tie_and_further_apart_do_not() -> None:
    # KV usage 0.1 vs 0.3 is 0.4 points at weight 2: a tie, so the two alternate.
    pipeline, _, _ = make(WITH_KV_USAGE)
    close = [worker("a", kv=0.1), worker("b", kv=0.3)]
    picks = [pipeline.route(request(), close).worker_id for _ in range(6)]  # type: ignore[union-attr]
    assert Counter(picks) == {"a": 3, "b": 3}
    # One queued request is a whole point: never a tie.
    apart = [worker("a", queue=1), worker("b")]
    assert {pipeline.route(request(), apart).worker_id for _ in range(6)} == {"b"}  # type: ignore[union-attr]


def test_zero_weight_drops_a_scorer_and_unknown_names_fail() -> None:
    pipeline, index, _ = make({"prefix_cache": 0.0, "queue_depth": 1.0})
    index.add(WorkerId("a"), PROMPT)
    decision = pipeline.route(request(), [worker("a", queue=1), worker("b")])
    assert decision is not None and decision.worker_id == "b"
    assert "prefix_cache" not in decision.scores
    with pytest.raises(RoutingConfigError, match="unknown scorer 'prefix'"):
        make({"prefix": 1.0})
    for weight in (-1.0, float("nan"), float("inf")):  # NaN scores would pick at random
        with pytest.raises(RoutingConfigError, match=">= 0"):
            make({"queue_depth": weight})


def test_header_value_explains_the_choice() -> None:
    pipeline, index, _ = make(WITH_KV_USAGE)
    index.add(WorkerId("a"), PROMPT[:4])
    decision = pipeline.route(request(), [worker("a", queue=1, kv=0.5)])
    assert decision is not None
    assert decision.header_value() == (
        "worker=a; score=2; prefix_cache=4; queue_depth=-1; session=0; kv_cache_usage=-0.5; "
        "prefix_blocks=4; best_prefix_blocks=4; candidates=1"
    )


def test_each_registered_scorer_reports_under_its_registered_name() -> None:
    inputs = ScorerInputs(BlockIndex(), SessionTable(), DEFAULT_STEP_COSTS)
    assert {name: build(inputs).name for name, build in SCORERS.items()} == {
        name: name for name in SCORERS
    }
    assert set(SCORER_ALIASES.values()) <= set(SCORERS) and not set(SCORER_ALIASES) & set(SCORERS)


def test_earlier_scorer_names_build_the_same_pipeline() -> None:
    # A configuration written with the scorers' earlier names routes and explains the same.
    old, index, _ = make({"prefix_blocks": 1.0, "queue_depth": 1.0, "kv_usage": 2.0})
    new, new_index, _ = make({"prefix_cache": 1.0, "queue_depth": 1.0, "kv_cache_usage": 2.0})
    for i in (index, new_index):
        i.add(WorkerId("a"), PROMPT[:4])
    workers = [worker("a", queue=1, kv=0.5), worker("b", kv=0.1)]
    decisions = [p.route(request(), workers) for p in (old, new)]
    assert decisions[0] is not None and decisions[0] == decisions[1]
    assert decisions[0].scores["prefix_cache"] == 4.0
    with pytest.raises(RoutingConfigError, match="'prefix_cache' twice"):
        make({"prefix_blocks": 1.0, "prefix_cache": 2.0})


def test_session_table_is_bounded_lru() -> None:
    sessions = SessionTable(max_sessions=2)
    sessions.set("x", WorkerId("a"))
    sessions.set("y", WorkerId("b"))
    assert sessions.get("x") == "a"  # x is now the most recent
    sessions.set("z", WorkerId("a"))
    assert sessions.get("y") is None and len(sessions) == 2
    sessions.forget_worker(WorkerId("a"))
    assert len(sessions) == 0
