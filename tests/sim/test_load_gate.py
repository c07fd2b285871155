"""The block policy's load gate (BLOCK_WEIGHTS, the default before the time-based scorer):
a cached prefix wins only among workers that are not much busier than average
(plugins.LoadGate, wired by build_pipeline)."""

from __future__ import annotations

import random

from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import BLOCK_WEIGHTS, build_pipeline
from kvflow.router.routing.plugins import LoadGate
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView

PROMPT = block_hashes(list(range(16 * 375)), block_size=16, seed=make_hash_seed("m"))


def view(name: str, queue: int) -> WorkerView:
    return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, queue, 0.0)


def route(queues: dict[str, int], gate: LoadGate | None) -> str:
    index = BlockIndex()
    index.add(WorkerId("hot"), PROMPT)  # a 6,000-token prefix: 375 blocks
    pipeline = build_pipeline(BLOCK_WEIGHTS, index=index, sessions=SessionTable(),
                              rng=random.Random(0), gate=gate)  # fmt: skip
    decision = pipeline.route(RouteRequest("m", PROMPT), [view(n, q) for n, q in queues.items()])
    assert decision is not None
    return decision.worker_id


def test_a_hot_prefix_spills_once_its_worker_is_over_the_line() -> None:
    gate = LoadGate(slack_fraction=0.5, slack_requests=4.0)
    # Mean 10: the line is 10 x 1.5 + 4 = 19. At 19 the prefix still wins...
    assert route({"hot": 19, "a": 6, "b": 5}, gate) == "hot"
    # ... at 20 it is over the line and the least-loaded other worker takes the request.
    assert route({"hot": 21, "a": 5, "b": 4}, gate) == "b"
    # Without the gate, 375 cached blocks outweigh any realistic queue.
    assert route({"hot": 300, "a": 0, "b": 0}, None) == "hot"


def test_the_gate_never_leaves_no_worker() -> None:
    gate = LoadGate(slack_fraction=0.0, slack_requests=0.0)
    assert [w.worker_id for w in gate.keep([view("a", 3), view("b", 3)])] == ["a", "b"]
    assert [w.worker_id for w in gate.keep([view("a", 9), view("b", 1)])] == ["b"]
    assert gate.keep([]) == []
