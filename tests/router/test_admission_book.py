"""Admission control reads the worker pool's book (serving/admission_control.py): the last
Load reports the pool's one poll recorded, plus what it admitted since the oldest of them,
so a burst admitted between two reports is counted as it is admitted."""

from __future__ import annotations

import time

import pytest

from kvflow.proto.roles import Role
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import ApiError
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import AdmissionConfig
from kvflow.router.serving.admission_control import AdmissionControl
from kvflow.router.tenants.config import Quotas, Tenant
from kvflow.router.workers.book import LoadReport, WorkerFacts
from kvflow.router.workers.pool import WorkerPool

W = WorkerId("w:1")
MODEL = "m"
# 2 waiting, 1 admitted a second: 2 s of queue; each admission adds a second.
REPORT = LoadReport(num_waiting=2, queue_drain_rate_per_s=1.0)


def test_admissions_since_the_report_count_until_a_newer_report() -> None:
    pool = WorkerPool(BlockIndex(), SessionTable())  # no addresses: nothing polls
    pool.book.add(W, WorkerFacts(MODEL, Role.COLOCATED, caches_prefixes=True), is_healthy=True)
    pool.book.apply_report(W, REPORT, at_s=time.monotonic())
    config = AdmissionConfig(shed_queue_time_s=3.0, max_queue_time_s=3.0)
    admission = AdmissionControl(pool, config, RouterMetrics(), "default")
    tenant = Tenant("t", None, 0, Quotas(), cache_salt="t")
    assert admission.check(tenant, MODEL).estimated_wait_s == 2.0
    assert admission.check(tenant, MODEL).estimated_wait_s == 3.0  # one admitted since
    with pytest.raises(ApiError) as refused:  # two since: 4 s of queue, over 3 s
        admission.check(tenant, MODEL)
    assert refused.value.status == 503
    # A report asked for after those admissions includes them: they no longer count.
    pool.book.apply_report(W, REPORT, at_s=time.monotonic())
    assert admission.check(tenant, MODEL).estimated_wait_s == 2.0
    assert admission.eligible_queues("other") == ([], 0)


def test_a_pool_with_no_worker_refuses_and_counts_the_demand() -> None:
    """Scaled to zero: a 503 at admission, counted as kvflow_router_admission_rejections
    {reason="no_worker"}, the demand the planner brings a replica back for (it saw nothing
    when the request went on to fail at the pool)."""
    pool = WorkerPool(BlockIndex(), SessionTable())
    metrics = RouterMetrics()
    admission = AdmissionControl(pool, AdmissionConfig(), metrics, "p")
    tenant = Tenant("t", None, 0, Quotas(), cache_salt="t")
    series = metrics.admission_rejections.labels("503", "no_worker", "p", "normal")
    assert series._value.get() == 0  # created at 0, so the planner reads 0, not nothing
    for _ in range(3):
        with pytest.raises(ApiError) as refused:
            admission.check(tenant, MODEL)
        assert refused.value.status == 503 and refused.value.retry_after_s is not None
    assert series._value.get() == 3
