"""The router's worker book (workers/book.py), pure: what routing and admission read from
one feed of load reports and this router's own requests."""

from __future__ import annotations

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.roles import Role
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import WorkerQueue
from kvflow.router.workers.book import LoadReport, WorkerBook, WorkerFacts
from kvflow.router.workers.convert import from_load_response

A, B, P = WorkerId("a:1"), WorkerId("b:1"), WorkerId("p:1")
MODEL = "m"


def book_of(*workers: tuple[WorkerId, Role]) -> WorkerBook:
    book = WorkerBook()
    for worker_id, role in workers:
        book.add(worker_id, WorkerFacts(MODEL, role, caches_prefixes=True), is_healthy=True)
    return book


def test_a_new_worker_is_unknown_until_its_health_and_load_say() -> None:
    book = WorkerBook()
    book.add(A)
    (view,) = book.views(0.0)
    assert (view.model, view.role, view.is_healthy, view.caches_prefixes) == (
        "", Role.COLOCATED, False, False)  # fmt: skip
    assert (view.queue_depth, view.kv_usage, view.load_at_s) == (0, 0.0, None)
    assert book.queues(MODEL, 0.0).queues == []  # nothing reported: nothing to judge


def test_views_carry_the_report_corrected_by_requests_opened_and_closed_since() -> None:
    book = book_of((A, Role.COLOCATED))
    book.open(A)
    report = LoadReport(num_waiting=2, num_running=3, kv_usage=0.5, num_prefill_tokens=70,
                        num_decode_seqs=3, num_kv_tokens=900, kv_capacity_tokens=4096,
                        num_cached_tokens=64)  # fmt: skip
    book.apply_report(A, report, at_s=10.0)  # the open one is in the report
    (view,) = book.views(10.0)
    assert view.queue_depth == 5
    assert (view.kv_usage, view.num_prefill_tokens, view.num_decode_seqs) == (0.5, 70, 3)
    assert (view.num_kv_tokens, view.kv_capacity_tokens, view.num_cached_tokens) == (
        900, 4096, 64)  # fmt: skip
    assert view.load_at_s == 10.0
    book.open(A)
    book.open(A)
    book.close(A)
    assert book.views(10.1)[0].queue_depth == 6  # +2 opened, -1 closed since
    for _ in range(3):
        book.close(A)
    assert book.views(10.2)[0].queue_depth == 4  # never below what was open at the report
    book.close(A)  # more closes than opens (a re-added worker): counts stay sane
    assert book.local_counts(A).num_open == 0


def test_an_answer_counts_what_was_open_when_it_was_asked_for() -> None:
    book = book_of((A, Role.COLOCATED))
    asked = book.local_counts(A)
    book.open(A)  # sent while the Load call was out: the report may not show it
    book.apply_report(A, LoadReport(num_waiting=1), at_s=1.0, asked=asked)
    assert book.views(1.0)[0].queue_depth == 2
    assert book.queues(MODEL, 1.0).num_opened_since_report == 1


def test_admission_reads_the_routable_streaming_workers_queues() -> None:
    book = book_of((A, Role.COLOCATED), (B, Role.DECODE), (P, Role.PREFILL))
    for worker_id, at_s in ((A, 3.0), (B, 2.0), (P, 1.0)):
        report = LoadReport(num_waiting=4, max_waiting_requests=8, queue_drain_rate_per_s=2.0)
        book.apply_report(worker_id, report, at_s)
    book.open(A)
    book.open(P)  # a prefill worker streams nothing: neither its queue nor its opens count
    found = book.queues(MODEL, 5.0)
    assert found.queues == [WorkerQueue(A, 4, 8, 2.0), WorkerQueue(B, 4, 8, 2.0)]
    assert found.num_opened_since_report == 1
    assert found.oldest_report_s == 2.0
    assert book.queues("other", 5.0).queues == []
    book.hold_busy(A, until_s=6.0)  # refused with a full queue: out until then
    assert [q.worker_id for q in book.queues(MODEL, 5.0).queues] == [B]
    assert [v.is_healthy for v in book.views(5.0)] == [False, True, True]
    assert [q.worker_id for q in book.queues(MODEL, 6.0).queues] == [A, B]
    book.set_healthy(B, False)
    assert [q.worker_id for q in book.queues(MODEL, 6.0).queues] == [A]


def test_a_removed_worker_is_forgotten_and_late_news_of_it_ignored() -> None:
    book = book_of((A, Role.COLOCATED))
    book.remove(A)
    book.apply_report(A, LoadReport(num_waiting=1), at_s=1.0)
    book.open(A)
    book.close(A)
    book.hold_busy(A, 2.0)
    assert A not in book
    assert book.views(0.0) == []


def test_a_load_response_converts_blocks_to_tokens() -> None:
    load = pb.LoadResponse(num_waiting=1, num_running=2, kv_usage=0.25, max_waiting_requests=9,
                           queue_drain_rate_per_s=1.5, num_prefill_tokens=30, num_decode_seqs=2,
                           num_kv_tokens=100, num_total_blocks=64, num_cached_blocks=3)  # fmt: skip
    assert from_load_response(load, block_size=16) == LoadReport(
        num_waiting=1, num_running=2, kv_usage=0.25, max_waiting_requests=9,
        queue_drain_rate_per_s=1.5, num_prefill_tokens=30, num_decode_seqs=2,
        num_kv_tokens=100, kv_capacity_tokens=1024, num_cached_tokens=48,
    )  # fmt: skip
