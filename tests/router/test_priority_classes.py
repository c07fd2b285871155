"""Priority classes at the router: what a request asks for (body, service_tier, header; 400
on an unknown word), the tenant's ceiling, the class on both halves of a worker request,
and admission's shedding order (batch first, then normal, realtime until hard full)."""

from __future__ import annotations

import time

import pytest

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.priority_class import HEADER, PriorityClass
from kvflow.proto.roles import Role
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.priority_class import applied_class, requested_class
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import (
    AdmissionConfig,
    TenantLoad,
    WorkerQueue,
    decide,
)
from kvflow.router.serving.admission_control import AdmissionControl
from kvflow.router.tenants.config import (
    ANONYMOUS,
    Quotas,
    Tenant,
    TenantConfigError,
    hash_api_key,
    parse_tenants,
)
from kvflow.router.workers.book import LoadReport, WorkerFacts
from kvflow.router.workers.convert import to_generate_request, to_prefill_request
from kvflow.router.workers.pool import WorkerPool
from kvflow.router.workers.records import (
    GenerateInput,
    KvReservation,
    PrefillInput,
    WorkerContext,
)

RT, NORMAL, BATCH = PriorityClass.REALTIME, PriorityClass.NORMAL, PriorityClass.BATCH


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({}, {}, None),
        ({HEADER: "batch"}, {}, BATCH),
        ({HEADER: " Realtime "}, {}, RT),  # a header's case and spaces do not matter
        ({HEADER: ""}, {}, None),  # an empty header names nothing
        ({}, {"priority_class": "realtime"}, RT),
        ({}, {"service_tier": "priority"}, RT),
        ({}, {"service_tier": "default"}, NORMAL),
        ({}, {"service_tier": "auto"}, NORMAL),
        ({}, {"service_tier": "flex"}, BATCH),
        ({HEADER: "realtime"}, {"priority_class": "batch"}, BATCH),  # the body wins
        ({HEADER: "realtime"}, {"service_tier": "flex"}, BATCH),
        ({}, {"priority_class": "batch", "service_tier": "priority"}, BATCH),
        ({HEADER: "batch"}, {"priority_class": None}, BATCH),  # null: not given
    ],
)
def test_requested_class(
    headers: dict[str, str], body: dict[str, object], expected: PriorityClass | None
) -> None:
    assert requested_class(headers, body) is expected


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({}, {"priority_class": "urgent"}, "priority_class"),
        ({}, {"service_tier": "scale"}, "service_tier"),
        ({HEADER: "asap"}, {}, HEADER),
        ({HEADER: "asap"}, {"priority_class": "nope"}, "priority_class"),
    ],
)
def test_an_unknown_word_is_a_400_that_names_the_accepted_ones(
    headers: dict[str, str], body: dict[str, object], param: str
) -> None:
    with pytest.raises(ApiError) as info:
        requested_class(headers, body)
    assert (info.value.status, info.value.param) == (400, param)
    assert "realtime, normal, batch" in info.value.message
    assert "priority, default, auto, flex" in info.value.message


def test_a_class_that_is_not_a_string_is_a_400() -> None:
    with pytest.raises(ApiError) as info:
        requested_class({}, {"priority_class": ["realtime"]})
    assert (info.value.status, info.value.param) == (400, "priority_class")
    assert "expected a string" in info.value.message


@pytest.mark.parametrize(
    ("requested", "ceiling", "applied"),
    [
        (None, NORMAL, NORMAL),
        (None, BATCH, BATCH),  # a batch-only tenant runs everything as batch
        (None, RT, NORMAL),  # a ceiling is a right, not a default
        (RT, NORMAL, NORMAL),
        (RT, RT, RT),
        (BATCH, RT, BATCH),  # asking for less is always allowed
        (NORMAL, BATCH, BATCH),
    ],
)
def test_the_tenant_ceiling_caps_the_class(
    requested: PriorityClass | None, ceiling: PriorityClass, applied: PriorityClass
) -> None:
    assert applied_class(requested, ceiling) is applied


def test_tenant_config_ceiling_defaults_to_normal_and_refuses_unknown_words() -> None:
    digest = hash_api_key("sk-a")
    tenants = parse_tenants([
        {"name": "a", "api_key_sha256": digest},
        {"name": "b", "api_key_sha256": hash_api_key("sk-b"), "max_priority_class": "realtime"},
    ]).tenants  # fmt: skip
    assert tenants["a"].max_priority_class is NORMAL
    assert tenants["b"].max_priority_class is RT
    assert ANONYMOUS.max_priority_class is NORMAL
    for bad in ("urgent", "priority", 1):  # service_tier words are for requests only
        with pytest.raises(TenantConfigError, match="max_priority_class must be one of"):
            parse_tenants([{"name": "a", "api_key_sha256": digest, "max_priority_class": bad}])


def test_the_class_reaches_both_halves_of_a_worker_request() -> None:
    context = WorkerContext("salt", tenant="acme", priority_class=RT)
    sampling = SamplingOptions(max_tokens=8, temperature=0.0, top_p=None, top_k=0, min_p=0.0,
                               seed=None, stop_strings=(), stop_token_ids=(), n=1,
                               logprobs=False, top_logprobs=0, ignore_eos=False)  # fmt: skip
    decode = to_generate_request(GenerateInput("r", [1], sampling, context))
    assert decode.context.priority_class == pb.PRIORITY_CLASS_REALTIME
    reservation = pb.KvReservation(version=pb.KV_HANDOFF_VERSION_1, transfer_id="t",
                                   first_token=0, end_token=16, kv_layout="L", tag=1)  # fmt: skip
    sent = KvReservation(0, 16, reservation.SerializeToString())
    prefill = to_prefill_request(PrefillInput("r", [1] * 20, context), sent)
    assert prefill.context == decode.context
    # Unset on the wire is normal to a worker: a router that predates classes.
    plain = to_generate_request(GenerateInput("r", [1], sampling, WorkerContext("salt")))
    assert PriorityClass.from_pb(plain.context.priority_class) is NORMAL


# Admission: shed 10 s, max 30 s; one worker at 4 admissions a second.
CONFIG = AdmissionConfig(shed_queue_time_s=10.0, max_queue_time_s=30.0)
UNDER_SHARE = TenantLoad(10, 1.0, 50, 2.0, 2)
OVER_SHARE = TenantLoad(40, 1.0, 50, 2.0, 2)


def queue(waiting: int, bound: int = 256) -> list[WorkerQueue]:
    return [WorkerQueue(WorkerId("a"), waiting, bound, 4.0)]


@pytest.mark.parametrize(
    ("queues", "tenant", "batch", "normal", "realtime"),
    [
        (queue(20), OVER_SHARE, "admitted", "admitted", "admitted"),  # 5 s
        (queue(60), UNDER_SHARE, "batch_shed", "admitted", "admitted"),  # 15 s: batch first
        (queue(60), OVER_SHARE, "batch_shed", "over_share", "admitted"),
        (queue(200), UNDER_SHARE, "batch_shed", "cluster_full", "admitted"),  # 50 s
        # Every queue at its bound: the workers bound each class's queue, and take realtime.
        (queue(256), UNDER_SHARE, "queues_full", "queues_full", "admitted"),
    ],
)
def test_admission_sheds_batch_first_then_normal_and_leaves_realtime_to_the_workers(
    queues: list[WorkerQueue], tenant: TenantLoad, batch: str, normal: str, realtime: str
) -> None:
    got = {cls: decide(queues, 0, tenant, CONFIG, cls).reason for cls in (BATCH, NORMAL, RT)}
    assert got == {BATCH: batch, NORMAL: normal, RT: realtime}


def test_a_shed_batch_request_gets_503_with_retry_after_and_is_counted_by_class() -> None:
    verdict = decide(queue(60), 0, UNDER_SHARE, CONFIG, BATCH)
    assert (verdict.status, verdict.retry_after_s) == (503, 5.0)  # 15 s, 5 over the line

    pool = WorkerPool(BlockIndex(), SessionTable())  # no addresses: nothing polls
    worker = WorkerId("w:1")
    pool.book.add(worker, WorkerFacts("m", Role.COLOCATED, caches_prefixes=True), is_healthy=True)
    pool.book.apply_report(worker, LoadReport(num_waiting=60, queue_drain_rate_per_s=4.0),
                           at_s=time.monotonic())  # fmt: skip
    metrics = RouterMetrics()
    admission = AdmissionControl(pool, CONFIG, metrics, "default")
    tenant = Tenant("t", None, 0, Quotas(), cache_salt="t")
    with pytest.raises(ApiError) as refused:
        admission.check(tenant, "m", BATCH)
    assert refused.value.status == 503 and refused.value.headers()["retry-after"] == "5"
    assert "batch requests are shed first" in refused.value.message
    assert admission.check(tenant, "m", RT).is_admitted
    assert admission.check(tenant, "m").is_admitted  # normal, by default
    value = metrics.registry.get_sample_value
    labels = {"priority_class": "batch", "reason": "batch_shed"}
    assert value("kvflow_router_priority_class_rejections_total", labels) == 1.0
    shed = {"code": "503", "reason": "batch_shed", "pool": "default", "priority_class": "batch"}
    assert value("kvflow_router_admission_rejections_total", shed) == 1.0
