"""Gateway admission decisions (serving/admission.py), table-driven with exact outcomes."""

from __future__ import annotations

import pytest

from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import (
    AdmissionConfig,
    AdmissionConfigError,
    TenantLoad,
    WorkerQueue,
    decide,
)

CONFIG = AdmissionConfig(shed_queue_time_s=10.0, max_queue_time_s=30.0)
ALONE = TenantLoad(num_in_flight=50, weight=1.0, num_in_flight_total=50,
                   active_weight_total=1.0, num_active_tenants=1)  # fmt: skip
# 40 of 50 in flight are this tenant's, one other tenant of equal weight has 10.
HOG = TenantLoad(40, 1.0, 50, 2.0, 2)
SMALL = TenantLoad(10, 1.0, 50, 2.0, 2)
NEW = TenantLoad(0, 1.0, 50, 2.0, 2)


def queue(name: str, waiting: int, rate: float, bound: int = 256) -> WorkerQueue:
    return WorkerQueue(WorkerId(name), waiting, bound, rate)


@pytest.mark.parametrize(
    ("queues", "dispatched", "tenant", "status", "reason", "retry_after_s"),
    [
        ([], 0, HOG, 200, "admitted", 0.0),  # no worker read yet: the pool answers
        ([queue("a", 20, 4.0)], 0, HOG, 200, "admitted", 0.0),  # 5 s: under the shed line
        ([queue("a", 60, 4.0)], 0, HOG, 429, "over_share", 5.0),  # 15 s and over its share
        ([queue("a", 60, 4.0)], 0, SMALL, 200, "admitted", 0.0),  # 15 s, under its share
        ([queue("a", 60, 4.0)], 0, NEW, 200, "admitted", 0.0),
        ([queue("a", 60, 4.0)], 0, ALONE, 200, "admitted", 0.0),  # the only tenant: no share
        ([queue("a", 200, 4.0)], 0, SMALL, 503, "cluster_full", 20.0),  # 50 s for everyone
        ([queue("a", 200, 4.0), queue("b", 8, 4.0)], 0, HOG, 200, "admitted", 0.0),  # b: 2 s
        # This router sent 160 since the last read: 80 more each, b is at 22 s now.
        ([queue("a", 200, 4.0), queue("b", 8, 4.0)], 160, HOG, 429, "over_share", 12.0),
        ([queue("a", 256, 4.0), queue("b", 300, 2.0, 300)], 0, NEW, 503, "queues_full", 1.0),
        ([queue("a", 256, 0.0)], 0, NEW, 503, "queues_full", 1.0),  # full, rate unknown
        ([queue("a", 500, 0.0, bound=0)], 0, HOG, 200, "admitted", 0.0),  # unbounded, unknown
        ([queue("a", 400, 2.0, bound=0)], 0, NEW, 503, "cluster_full", 60.0),  # Retry-After capped
    ],
)
def test_decide(
    queues: list[WorkerQueue],
    dispatched: int,
    tenant: TenantLoad,
    status: int,
    reason: str,
    retry_after_s: float,
) -> None:
    verdict = decide(queues, dispatched, tenant, CONFIG)
    assert (verdict.status, verdict.reason) == (status, reason)
    assert verdict.retry_after_s == pytest.approx(retry_after_s)


def test_priority_weights_the_share() -> None:
    # 30 of 50 in flight: over an equal share, within a share twice the other's.
    assert TenantLoad(30, 1.0, 50, 2.0, 2).is_over_share()
    assert not TenantLoad(30, 2.0, 50, 3.0, 2).is_over_share()


def test_disabled_admits_everything() -> None:
    off = AdmissionConfig(is_enabled=False)
    assert decide([queue("a", 256, 1.0)], 0, NEW, off).is_admitted


def test_config_from_env() -> None:
    env = {"KVFLOW_ADMISSION_SHED_QUEUE_TIME_S": "2", "KVFLOW_ADMISSION_MAX_QUEUE_TIME_S": "4.5"}
    assert AdmissionConfig.from_env(env) == AdmissionConfig(2.0, 4.5)
    assert not AdmissionConfig.from_env({"KVFLOW_ADMISSION": "off"}).is_enabled
    with pytest.raises(AdmissionConfigError, match=r"SHED_QUEUE_TIME_S \(60.0\) must be at most"):
        AdmissionConfig.from_env({"KVFLOW_ADMISSION_SHED_QUEUE_TIME_S": "60"})
    with pytest.raises(AdmissionConfigError, match="must be a number of seconds, got 'soon'"):
        AdmissionConfig.from_env({"KVFLOW_ADMISSION_MAX_QUEUE_TIME_S": "soon"})
    with pytest.raises(AdmissionConfigError, match="POLL_INTERVAL_S must be > 0"):
        AdmissionConfig.from_env({"KVFLOW_ADMISSION_POLL_INTERVAL_S": "0"})
    with pytest.raises(AdmissionConfigError, match="on or off"):
        AdmissionConfig.from_env({"KVFLOW_ADMISSION": "maybe"})
