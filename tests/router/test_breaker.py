"""The circuit breaker's state machine, the pool's circuit and what routing makes of them:
exact times in, exact states out (the real-process tests are
tests/gateway/test_circuit_breaker.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvflow.loadgen.payloads import parse_route_header
from kvflow.proto.roles import Role
from kvflow.router.breaker.machine import (
    Breaker,
    BreakerConfig,
    BreakerConfigError,
    CircuitState,
    Outcome,
)
from kvflow.router.breaker.pool import BUSY_PROBES_RETRY_S, pool_refusal, pool_state
from kvflow.router.cli import parse_args
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import build_pipeline
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView
from kvflow.router.settings import ConfigError
from kvflow.router.workers.book import LoadReport, WorkerBook, WorkerFacts
from kvflow.router.workers.deadlines import DeadlineKind, DeadlineMiss
from kvflow.router.workers.errors import (
    RequestRejectedError,
    WorkerBusyError,
    WorkerCallError,
    WorkerDownError,
    WorkerStalledError,
)
from kvflow.router.workers.pool import WorkerPool

CLOSED, HALF_OPEN, OPEN = CircuitState.CLOSED, CircuitState.HALF_OPEN, CircuitState.OPEN
OK, ERROR, TIMEOUT, STALL = Outcome.SUCCESS, Outcome.ERROR, Outcome.TIMEOUT, Outcome.STALL
CONFIG = BreakerConfig(failure_rate=0.5, window_s=10.0, min_requests=4, open_s=5.0,
                       max_open_s=20.0, half_open_probes=2)  # fmt: skip
MIN_CALLS = CONFIG.min_requests


def send(breaker: Breaker, outcome: Outcome, now_s: float) -> None:
    breaker.finish(breaker.start(now_s), outcome, now_s)


def tripped(config: BreakerConfig = CONFIG, at_s: float = 0.0) -> Breaker:
    breaker = Breaker(config)
    send(breaker, STALL, at_s)
    assert breaker.state(at_s) is OPEN
    return breaker


def test_the_failure_rate_opens_only_from_the_minimum_number_of_requests() -> None:
    breaker = Breaker(CONFIG)
    for i in range(3):  # every request fails, but 3 are too few to judge
        send(breaker, ERROR, float(i))
        assert breaker.state(float(i)) is CLOSED and breaker.admits(float(i))
    send(breaker, TIMEOUT, 3.0)  # the 4th: 4 of 4 failed
    assert breaker.state(3.0) is OPEN and not breaker.admits(3.0)
    assert breaker.last_trip == "4 of 4 requests failed in the last 10 s"


def test_the_rate_opens_at_the_threshold_not_below_it() -> None:
    below = Breaker(CONFIG)
    for outcome in (OK, OK, OK, ERROR, OK, ERROR):  # 2 of 6: 0.33
        send(below, outcome, 1.0)
    assert below.state(1.0) is CLOSED
    at = Breaker(CONFIG)
    for outcome in (OK, ERROR, OK, ERROR):  # 2 of 4: 0.5, the threshold
        send(at, outcome, 1.0)
    assert at.state(1.0) is OPEN


def test_failures_leave_the_sliding_window() -> None:
    breaker = Breaker(CONFIG)
    for _ in range(3):
        send(breaker, ERROR, 0.0)
    # 11 s later those three are out of the 10 s window: one more failure is 1 of 1.
    send(breaker, ERROR, 11.0)
    assert breaker.state(11.0) is CLOSED
    assert (breaker.counts(11.0).num_requests, breaker.counts(11.0).num_failures) == (1, 1)
    for _ in range(3):
        send(breaker, ERROR, 12.0)
    assert breaker.state(12.0) is OPEN


def test_one_stall_opens_at_once() -> None:
    breaker = Breaker(CONFIG)
    send(breaker, OK, 0.0)
    send(breaker, STALL, 1.0)
    assert breaker.state(1.0) is OPEN
    assert "stalled" in breaker.last_trip


def test_open_for_its_time_then_half_open_for_a_bounded_number_of_probes() -> None:
    breaker = tripped(at_s=100.0)
    assert breaker.open_remaining_s(101.0) == 4.0
    assert not breaker.admits(104.9)
    assert breaker.state(105.0) is HALF_OPEN and breaker.admits(105.0)
    first, second = breaker.start(105.0), breaker.start(105.1)
    assert first.is_probe and second.is_probe
    assert not breaker.admits(105.2)  # both probes are out: nothing else goes
    breaker.abandon(first, 105.3)  # the client left: no verdict, its probe is free again
    assert breaker.admits(105.3)
    third = breaker.start(105.4)
    breaker.finish(second, OK, 106.0)
    assert breaker.state(106.0) is HALF_OPEN  # one success of two
    breaker.finish(third, OK, 106.5)
    assert breaker.state(106.5) is CLOSED and breaker.admits(106.5)
    assert breaker.counts(106.5).num_requests == 0  # the window starts afresh


def test_a_failed_probe_reopens_for_twice_as_long_up_to_the_cap() -> None:
    breaker = tripped(at_s=0.0)
    now_s, open_times = 0.0, []
    for _ in range(4):
        now_s += breaker.open_remaining_s(now_s)
        assert breaker.state(now_s) is HALF_OPEN
        send(breaker, ERROR, now_s)
        open_times.append(breaker.open_remaining_s(now_s))
    assert open_times == [10.0, 20.0, 20.0, 20.0]  # 5 s doubled, capped at 20 s
    # Two successes close it, and the next trip starts from 5 s again.
    now_s += 20.0
    send(breaker, OK, now_s)
    send(breaker, OK, now_s)
    assert breaker.state(now_s) is CLOSED
    send(breaker, STALL, now_s)
    assert breaker.open_remaining_s(now_s) == 5.0


def test_verdicts_from_before_the_last_transition_are_ignored() -> None:
    breaker = Breaker(CONFIG)
    early = breaker.start(0.0)  # sent while closed, answers late
    send(breaker, STALL, 1.0)
    breaker.finish(early, OK, 7.0)  # now half-open: not a probe, it must not count
    assert breaker.state(7.0) is HALF_OPEN and breaker.admits(7.0)
    probe = breaker.start(7.0)
    breaker.finish(probe, OK, 7.5)
    send(breaker, OK, 7.6)
    assert breaker.state(7.6) is CLOSED
    breaker.finish(early, ERROR, 8.0)  # a stale failure does not enter the fresh window
    assert breaker.counts(8.0).num_requests == 0


def test_transitions_are_reported_in_order() -> None:
    seen: list[tuple[CircuitState, CircuitState]] = []
    breaker = Breaker(CONFIG, lambda was, to: seen.append((was, to)))
    send(breaker, STALL, 0.0)
    assert breaker.state(5.0) is HALF_OPEN and seen == [(CLOSED, OPEN)]  # reading changes nothing
    send(breaker, TIMEOUT, 5.0)  # the probe fails
    send(breaker, OK, 15.0)
    send(breaker, OK, 15.0)
    assert seen == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN),
                    (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]  # fmt: skip


def test_a_disabled_breaker_never_opens() -> None:
    breaker = Breaker(BreakerConfig(is_enabled=False, min_requests=1))
    for i in range(20):
        send(breaker, STALL, float(i))
    assert breaker.state(20.0) is CLOSED and breaker.admits(20.0)


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"failure_rate": 0.0}, "--breaker-error-rate"),
        ({"failure_rate": 1.5}, "--breaker-error-rate"),
        ({"window_s": 0.0}, "--breaker-window-s"),
        ({"min_requests": 0}, "--breaker-min-requests"),
        ({"open_s": 30.0, "max_open_s": 10.0}, "--breaker-max-open-s"),
        ({"half_open_probes": 0}, "--breaker-half-open-probes"),
    ],
)
def test_a_setting_out_of_range_names_its_flag(fields: dict[str, float], flag: str) -> None:
    with pytest.raises(BreakerConfigError, match=flag):
        BreakerConfig(**fields)  # type: ignore[arg-type]


def test_the_flags_make_the_settings_and_refuse_a_bad_combination() -> None:
    flags = ["--breaker-error-rate", "0.25", "--breaker-window-s", "60",
             "--breaker-min-requests", "20", "--breaker-open-s", "2",
             "--breaker-max-open-s", "8", "--breaker-half-open-probes", "3"]  # fmt: skip
    settings = parse_args(flags)
    assert settings is not None
    assert settings.breaker == BreakerConfig(
        failure_rate=0.25, window_s=60.0, min_requests=20, open_s=2.0, max_open_s=8.0,
        half_open_probes=3,
    )  # fmt: skip
    default = parse_args([])
    assert default is not None and default.breaker == BreakerConfig()
    off = parse_args(["--breaker", "off"])
    assert off is not None and not off.breaker.is_enabled
    with pytest.raises(ConfigError, match="--breaker-max-open-s"):
        parse_args(["--breaker-open-s", "30", "--breaker-max-open-s", "10"])


# -- the pool's circuit ------------------------------------------------------------------------


def test_a_pool_refuses_while_every_healthy_worker_is_open_until_the_first_half_opens() -> None:
    own = Breaker(CONFIG)
    a, b = tripped(at_s=0.0), tripped(at_s=2.0)
    refusal = pool_refusal(own, [a, b], 3.0)
    assert refusal is not None and refusal.retry_after_s == 2.0  # a half-opens at 5 s
    assert "all its 2 healthy workers" in refusal.why
    assert pool_state(own, [a, b], 3.0) is OPEN
    assert pool_refusal(own, [a, b], 5.0) is None  # a takes a probe
    assert pool_state(own, [a, b], 5.0) is HALF_OPEN  # (and only probes go)
    assert pool_state(own, [a, Breaker(CONFIG)], 3.0) is CLOSED
    assert pool_refusal(own, [a, Breaker(CONFIG)], 3.0) is None  # one worker is closed
    assert pool_refusal(own, [], 3.0) is None  # no healthy worker: another 503 says so
    # Half-open workers whose probes are all out: come back in a second.
    for _ in range(2):
        a.start(5.0)
    refusal = pool_refusal(own, [a], 5.0)
    assert refusal is not None and refusal.retry_after_s == BUSY_PROBES_RETRY_S


def test_a_pool_refuses_while_its_own_circuit_is_open() -> None:
    own = tripped(at_s=10.0)
    refusal = pool_refusal(own, [Breaker(CONFIG)], 12.0)
    assert refusal is not None and refusal.retry_after_s == 3.0
    assert "its own circuit is open" in refusal.why
    assert pool_refusal(own, [Breaker(CONFIG)], 15.0) is None  # half-open: a probe goes


# -- what routing makes of it ----------------------------------------------------------------


def view(worker_id: str, circuit: CircuitState = CLOSED) -> WorkerView:
    return WorkerView(WorkerId(worker_id), "m", Role.COLOCATED, is_healthy=True, queue_depth=0,
                      kv_usage=0.0, circuit=circuit)  # fmt: skip


def pipeline_route(workers: list[WorkerView]) -> str | None:
    index, sessions = BlockIndex(), SessionTable()
    pipeline = build_pipeline({"queue_depth": 1.0}, index=index, sessions=sessions,
                              rng=random.Random(0))  # fmt: skip
    decision = pipeline.route(RouteRequest("m", []), workers)
    return None if decision is None else decision.header_value()


def test_routing_never_picks_an_open_circuit_and_says_which_it_left_out() -> None:
    for _ in range(5):
        header = pipeline_route([view("a:1", OPEN), view("b:1"), view("c:1", OPEN)])
        assert header is not None and header.startswith("worker=b:1;")
        assert "circuit_open=a:1|c:1" in header and "circuit=" not in header
        # The load generator still reads the route's worker, after a failover's ", " too.
        route = parse_route_header(f"worker=a:1; score=0, {header}")
        assert route is not None and route.worker == "b:1"
    assert pipeline_route([view("a:1", OPEN)]) is None
    probe = pipeline_route([view("a:1", HALF_OPEN), view("b:1", OPEN)])
    assert probe is not None and probe.startswith("worker=a:1;")
    assert "circuit=half_open" in probe and "circuit_open=b:1" in probe
    assert "circuit" not in (pipeline_route([view("a:1"), view("b:1")]) or "")


def test_the_book_shows_each_circuit_and_a_half_open_one_with_its_probes_out_as_open() -> None:
    book = WorkerBook(CONFIG)
    facts = WorkerFacts("m", Role.COLOCATED, caches_prefixes=True)
    for worker_id in ("a:1", "b:1"):
        book.add(WorkerId(worker_id), facts, is_healthy=True)
        book.apply_report(WorkerId(worker_id), LoadReport(max_waiting_requests=8), 0.0)
    breaker = book.breaker(WorkerId("a:1"))
    assert breaker is not None
    send(breaker, STALL, 0.0)

    def circuits(now_s: float) -> dict[str, CircuitState]:
        return {v.worker_id: v.circuit for v in book.views(now_s)}

    assert circuits(1.0) == {"a:1": OPEN, "b:1": CLOSED}
    assert [q.worker_id for q in book.queues("m", 1.0).queues] == ["b:1"]  # no capacity
    assert circuits(5.0)["a:1"] is HALF_OPEN
    breaker.start(5.0)
    breaker.start(5.0)
    assert circuits(5.0)["a:1"] is OPEN  # its probes are out
    assert book.circuits(5.0)[WorkerId("a:1")] is HALF_OPEN  # (its real state, for the gauge)


# -- the pool's shell: which failure says what -------------------------------------------------


def pool_with_worker() -> tuple[WorkerPool, WorkerId]:
    pool = WorkerPool(BlockIndex(), SessionTable(), breaker=CONFIG)
    worker_id = WorkerId("a:1")
    pool.book.add(worker_id, WorkerFacts("m", Role.COLOCATED, caches_prefixes=True),
                  is_healthy=True)  # fmt: skip
    return pool, worker_id


def fail_on(pool: WorkerPool, worker_id: WorkerId, exc: Exception) -> None:
    with pytest.raises(type(exc)), pool.request_open(worker_id):
        raise exc


def test_a_stalled_call_opens_its_worker_and_a_refused_or_full_one_says_nothing() -> None:
    pool, worker_id = pool_with_worker()
    for _ in range(MIN_CALLS):
        fail_on(pool, worker_id, RequestRejectedError(worker_id, "INVALID_ARGUMENT: bad"))
        fail_on(pool, worker_id, WorkerBusyError(worker_id, "RESOURCE_EXHAUSTED", 1.0))
        fail_on(pool, worker_id, asyncio.CancelledError())
    assert pool.worker_circuits()[worker_id] is CLOSED
    miss = DeadlineMiss(DeadlineKind.FIRST_TOKEN, 2.0, 2.0)
    fail_on(pool, worker_id, WorkerStalledError(worker_id, miss))
    assert pool.worker_circuits()[worker_id] is OPEN
    refusal = pool.circuit_refusal()  # its only worker
    assert refusal is not None and "stalled" in refusal.why


def test_errors_open_a_worker_at_the_rate_and_successes_keep_it_closed() -> None:
    pool, worker_id = pool_with_worker()
    for _ in range(MIN_CALLS):
        with pool.request_open(worker_id):
            pass  # a stream that ran to its end
    for _ in range(MIN_CALLS - 1):
        fail_on(pool, worker_id, WorkerDownError(worker_id, "UNAVAILABLE: gone"))
    assert pool.worker_circuits()[worker_id] is CLOSED  # 3 of 7
    fail_on(pool, worker_id, WorkerCallError(worker_id, "ABORTED: cut short"))
    assert pool.worker_circuits()[worker_id] is OPEN  # 4 of 8


def test_one_stalled_choice_does_not_shut_the_pool() -> None:
    pool, _ = pool_with_worker()
    pool.choice_ended(pool.choice_started(), Outcome.STALL)
    assert pool.circuit_state() is CLOSED and pool.circuit_refusal() is None
    for _ in range(MIN_CALLS - 1):
        pool.choice_ended(pool.choice_started(), Outcome.ERROR)
    refusal = pool.circuit_refusal()  # 4 of 4 choices failed: the pool's own circuit
    assert refusal is not None and "its own circuit is open" in refusal.why
    assert pool.circuit_state() is OPEN
