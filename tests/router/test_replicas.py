"""Copies of shared prefixes (routing/replicas.py): the time scorer rents a prefix where it
is until the rent adds up to a copy's price, then sends the next request to the worker
that would be best with the prefix, which prefills it there once."""

from __future__ import annotations

import random

from kvflow.proto.block_hash import BlockHash, block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS, TimeCostScorer
from kvflow.router.routing.pipeline import DEFAULT_WEIGHTS, build_pipeline
from kvflow.router.routing.replicas import ReplicaLedger
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView

SEED = make_hash_seed("m")
PREAMBLE = list(range(4096))  # 0.11 s of prefill at the default step costs


def view(name: str, **kw: object) -> WorkerView:
    return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, 0, 0.0, **kw)  # type: ignore[arg-type]


def prompt(i: int) -> tuple[list[BlockHash], int]:
    tokens = PREAMBLE + [10_000 + i] * 800
    return block_hashes(tokens, block_size=16, seed=SEED), len(tokens)


def test_the_ledger_rents_until_the_rent_paid_reaches_the_price() -> None:
    ledger = ReplicaLedger()
    prefix = BlockHash(7)
    assert not ledger.should_copy(prefix, 0.04, 0.1)
    assert not ledger.should_copy(prefix, 0.04, 0.1)
    assert ledger.rent_s(prefix) == 0.08
    assert ledger.should_copy(prefix, 0.04, 0.1)  # 0.12 paid: buy
    assert ledger.rent_s(prefix) == 0.0  # one more holder: the rent starts over
    # No rent (the prefix's worker is the best one anyway) never buys, however cheap.
    assert not ledger.should_copy(prefix, 0.0, 0.0)


def test_the_ledger_is_bounded() -> None:
    ledger = ReplicaLedger(max_prefixes=2)
    for i in range(3):
        ledger.should_copy(BlockHash(i), 0.01, 1.0)
    assert len(ledger) == 2
    assert ledger.rent_s(BlockHash(0)) == 0.0  # the least recently paid went first


def _route_stream(workers: list[WorkerView], prompts: list[int]) -> list[str]:
    index = BlockIndex()
    index.add(WorkerId("holder"), prompt(0)[0][:256])  # the preamble's 256 blocks
    pipeline = build_pipeline(DEFAULT_WEIGHTS, index=index, sessions=SessionTable(),
                              rng=random.Random(0))  # fmt: skip
    chosen: list[str] = []
    for i in prompts:
        hashes, num_tokens = prompt(i)
        request = RouteRequest("m", hashes, num_prompt_tokens=num_tokens, block_size=16)
        decision = pipeline.route(request, workers)
        assert decision is not None
        chosen.append(decision.worker_id)
    return chosen


def test_a_shared_prefix_on_a_busy_worker_is_copied_once_its_rent_adds_up() -> None:
    """The preamble's worker has a prompt of 1,500 tokens queued (41 ms), the other none:
    each request that starts with the preamble still saves more there (111 ms of prefill)
    and goes there, paying the holder's excess over the pool's mean (20 ms) as rent, until
    the sixth would have paid 122 ms in all, more than the copy's 111 ms: it goes to the
    idle worker, which prefills the preamble."""
    workers = [view("holder", num_prefill_tokens=1500), view("idle")]
    assert _route_stream(workers, list(range(1, 8))) == ["holder"] * 5 + ["idle", "holder"]


def test_a_holder_no_busier_than_the_typical_worker_pays_no_rent() -> None:
    """Rent is the holder's excess over the pool's mean, not over the idlest worker: a dip
    in one worker's queue is noise every placement pays, and copying on it spent the
    shared-prefix comparison's hit rate (docs/benchmarks.md). Against the idlest worker
    the third request here would have bought a copy."""
    workers = [view("holder", num_prefill_tokens=1500), view("idle"),
               view("busy", num_prefill_tokens=3000)]  # fmt: skip
    assert _route_stream(workers, list(range(1, 21))) == ["holder"] * 20


def test_a_prefix_used_once_is_never_copied() -> None:
    """Each request's whole prompt is its own (a conversation's history): its rent is paid
    once, under the price, so no copy is ever bought."""
    index = BlockIndex()
    scorer = TimeCostScorer(index, DEFAULT_STEP_COSTS, replicas=ReplicaLedger())
    workers = [view("holder", num_prefill_tokens=1500), view("idle")]
    for i in range(20):
        tokens = [20_000 + i] * 4096 + [30_000 + i] * 800
        hashes = block_hashes(tokens, block_size=16, seed=SEED)
        index.add(WorkerId("holder"), hashes[:256])
        request = RouteRequest("m", hashes, num_prompt_tokens=len(tokens), block_size=16)
        scores = scorer.score(request, workers)
        assert scores[WorkerId("holder")] > scores[WorkerId("idle")]
    assert scorer.num_copies == 0
