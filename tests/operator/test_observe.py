"""The planner's inputs from real workers' and routers' metrics text (pure parsing).

The exposition comes from the components' own metric classes (`WorkerMetrics`,
`RouterMetrics`), so a renamed or retyped family fails here, not in a cluster.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.operator.observe.exposition import ExpositionError, Histogram, Metrics, parse, window
from kvflow.operator.observe.histograms import quantile, share_above
from kvflow.operator.observe.observation import (
    ROUTER_FAMILIES,
    ROUTER_SHED,
    WORKER_FAMILIES,
    Slo,
    Targets,
    gateway_match,
    observe_role,
)
from kvflow.operator.observe.pods import RolePods, classify
from kvflow.router.metrics import RouterMetrics

SLO = Slo(ttft_target_s=1.0, tpot_target_s=0.1, percentile=90)


def worker_text(m: WorkerMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_every_family_the_planner_reads_is_exported_with_its_type() -> None:
    worker = parse(worker_text(WorkerMetrics()), WORKER_FAMILIES)
    served = RouterMetrics()
    # The gateway's latency histograms are labelled by model: a series exists once a
    # request has been answered (before that the planner sees no TTFT, as in a new pool).
    served.ttft_s.labels("smollm2", "normal").observe(0.1)
    served.tpot_s.labels("smollm2", "normal").observe(0.01)
    router = parse(generate_latest(served.registry).decode(), ROUTER_FAMILIES)
    found = {*worker.counters, *worker.gauges, *worker.histograms}
    assert found == set(WORKER_FAMILIES)
    assert {*router.histograms, *router.counters} == set(ROUTER_FAMILIES)
    assert set(router.counters) == {ROUTER_SHED}  # present at 0 before any refusal
    assert set(worker.counters) == {
        "kvflow_worker_requests_finished",
        "kvflow_worker_prompt_tokens",
        "kvflow_worker_generation_tokens",
    }
    assert set(worker.gauges) == {
        "kvflow_worker_requests_running",
        "kvflow_worker_requests_waiting",
        "kvflow_worker_kv_cache_usage_ratio",
        "kvflow_worker_kv_cache_class_usage_ratio",
    }


def test_a_window_is_the_difference_of_two_reads() -> None:
    m = WorkerMetrics()
    m.finished.labels("stop", "normal").inc(3)
    m.tpot.labels("normal").observe(0.05)
    before = parse(worker_text(m), WORKER_FAMILIES)
    m.finished.labels("stop", "normal").inc(2)
    m.finished.labels("length", "normal").inc(5)  # labels are summed
    m.prompt_tokens.labels("normal").inc(700)
    m.tpot.labels("normal").observe(0.5)
    m.running.labels("normal").set(7)
    delta = window(parse(worker_text(m), WORKER_FAMILIES), before)
    assert delta.counters["kvflow_worker_requests_finished"] == 7
    assert delta.counters["kvflow_worker_prompt_tokens"] == 700
    assert delta.histograms["kvflow_worker_time_per_output_token_seconds"].count == 1
    assert delta.gauges["kvflow_worker_requests_running"] == 7  # gauges: the latest read


def test_a_restarted_target_counts_from_its_start() -> None:
    m = WorkerMetrics()
    m.finished.labels("stop", "normal").inc(10)
    before = parse(worker_text(m), WORKER_FAMILIES)
    fresh = WorkerMetrics()
    fresh.finished.labels("stop", "normal").inc(2)
    now = parse(worker_text(fresh), WORKER_FAMILIES)
    assert window(now, before).counters["kvflow_worker_requests_finished"] == 2


def test_garbage_is_refused_clearly() -> None:
    with pytest.raises(ExpositionError, match="not Prometheus text"):
        parse("this is { not metrics", WORKER_FAMILIES)


def test_a_nan_sample_is_not_measured_not_calm() -> None:
    """A NaN gauge (a KV usage its exporter could not tell) summed into the read made the
    role look calm (NaN compares false with every limit); it is left out, as if absent."""
    usage = "kvflow_worker_kv_cache_usage_ratio"
    text = (
        f"# TYPE {usage} gauge\n{usage} NaN\n"
        "# TYPE kvflow_worker_requests_waiting gauge\nkvflow_worker_requests_waiting 2\n"
    )
    read = parse(text, WORKER_FAMILIES)
    assert usage not in read.gauges and read.gauges["kvflow_worker_requests_waiting"] == 2


def hist(bounds: tuple[float, ...], counts: tuple[float, ...]) -> Histogram:
    cumulative = tuple(sum(counts[: i + 1]) for i in range(len(counts)))
    return Histogram(bounds, cumulative, cumulative[-1], 0.0)


def test_quantile_and_violation_share_interpolate_in_buckets() -> None:
    # 10 requests: 5 in (0, 0.1], 4 in (0.1, 0.2], 1 above 0.4.
    h = hist((0.1, 0.2, 0.4, float("inf")), (5, 4, 0, 1))
    assert quantile(h, 0.5) == pytest.approx(0.1)
    assert quantile(h, 0.7) == pytest.approx(0.15)
    assert quantile(h, 0.99) == pytest.approx(0.4)  # in +Inf: the last finite bound
    assert share_above(h, 0.1) == pytest.approx(0.5)
    assert share_above(h, 0.15) == pytest.approx(0.3)
    assert share_above(h, 1.0) == pytest.approx(0.1)
    assert quantile(hist((0.1, float("inf")), (0, 0)), 0.9) is None
    assert share_above(None, 0.1) is None


def test_observation_of_a_colocated_role() -> None:
    w1, w2, router = WorkerMetrics(), WorkerMetrics(), RouterMetrics()
    for m, running, waiting, kv in ((w1, 4, 3, 0.5), (w2, 8, 2, 0.7)):
        m.finished.labels("stop", "normal").inc(10)
        m.prompt_tokens.labels("normal").inc(2000)
        m.generation_tokens.labels("normal").inc(500)
        m.running.labels("normal").set(running)
        m.waiting.labels("normal").set(waiting)
        m.kv_usage.set(kv)
        m.kv_class_usage.labels("normal").set(kv)  # all of it held by normal requests
        for _ in range(10):
            m.tpot.labels("normal").observe(0.3)  # every request over the 100 ms target
            m.queue_wait.labels("normal").observe(0.2)
            m.ttft.labels("normal").observe(5.0)
    for i in range(20):  # the gateway's TTFT wins over the workers', summed over models
        router.ttft_s.labels(("smollm2-v1", "smollm2-v2")[i % 2], "normal").observe(0.4)
    obs = observe_role(
        "colocated",
        time_s=100.0,
        window_s=10.0,
        desired_replicas=2,
        pods=RolePods(ready_replicas=2, pending_replicas=1, unschedulable_replicas=1),
        targets=Targets(
            workers=[parse(worker_text(m), WORKER_FAMILIES) for m in (w1, w2)],
            routers=[parse(generate_latest(router.registry).decode(), ROUTER_FAMILIES)],
        ),
        slo=SLO,
    )
    assert obs.request_rate_per_s == pytest.approx(2.0)
    assert obs.mean_input_tokens == pytest.approx(200)
    assert obs.mean_output_tokens == pytest.approx(50)
    assert obs.tpot_violation_fraction == pytest.approx(1.0)
    assert obs.tpot_s is not None and 0.2 < obs.tpot_s <= 0.3
    assert obs.ttft_s is not None and 0.25 < obs.ttft_s <= 0.5
    assert obs.ttft_violation_fraction == pytest.approx(0.0)
    assert obs.prefill_queue_wait_s == pytest.approx(0.2)
    assert obs.decode_batch_size == pytest.approx(6)
    assert obs.kv_usage == pytest.approx(0.6)
    assert obs.num_waiting_requests == pytest.approx(5)  # summed: the role's whole queue
    assert (obs.ready_replicas, obs.pending_replicas, obs.unschedulable_replicas) == (2, 1, 1)


def test_requests_the_gateway_refused_are_demand_and_late() -> None:
    """Admission control answered 503 (and 429) before any worker saw those requests: the
    workers' counters miss them, the routers' count them. A role that prefills adds them
    to its rate and counts them over the TTFT target; a decode role does not see them."""
    worker, router = WorkerMetrics(), RouterMetrics()
    worker.finished.labels("stop", "normal").inc(30)
    worker.prompt_tokens.labels("normal").inc(3000)
    for _ in range(30):
        router.ttft_s.labels("m", "normal").observe(0.2)  # every served request on time
    router.admission_rejections.labels("503", "cluster_full", "default", "normal").inc(8)
    router.admission_rejections.labels("429", "over_share", "default", "normal").inc(2)
    targets = Targets(
        workers=[parse(worker_text(worker), WORKER_FAMILIES)],
        routers=[parse(generate_latest(router.registry).decode(), ROUTER_FAMILIES)],
    )
    kwargs = {"time_s": 0.0, "window_s": 10.0, "desired_replicas": 1, "pods": RolePods(1)}
    obs = observe_role("colocated", targets=targets, slo=SLO, **kwargs)  # type: ignore[arg-type]
    assert obs.request_rate_per_s == pytest.approx(4.0)  # (30 served + 10 refused) / 10 s
    assert obs.mean_input_tokens == pytest.approx(100)  # of the served: the refused sent none
    assert obs.ttft_s is not None and obs.ttft_s <= 0.25  # the served were fast...
    assert obs.ttft_violation_fraction == pytest.approx(0.25)  # ...but 10 of 40 got nothing
    assert obs.shed_fraction == pytest.approx(0.25)
    decode = observe_role("decode", targets=targets, slo=SLO, **kwargs)  # type: ignore[arg-type]
    assert decode.request_rate_per_s == pytest.approx(3.0)
    assert decode.shed_fraction is None
    quiet = RouterMetrics()  # no refusal: the share is 0, not unknown
    calm = Targets(
        targets.workers, [parse(generate_latest(quiet.registry).decode(), ROUTER_FAMILIES)]
    )
    obs = observe_role("colocated", targets=calm, slo=SLO, **kwargs)  # type: ignore[arg-type]
    assert obs.shed_fraction == 0.0 and obs.request_rate_per_s == pytest.approx(3.0)


def test_a_gateway_in_front_of_two_pools_counts_for_each_only_its_own() -> None:
    """An InferenceGateway's routers report every pool they front: pool `a`'s planner reads
    a's refusals (by the `pool` label) and the latencies of a's served name (by `model`),
    and pool `b`'s refusals and slow requests are none of its business."""
    gateway = RouterMetrics()
    for pool in ("a", "b"):
        gateway.admission_pool(pool)
    gateway.admission_rejections.labels("503", "cluster_full", "a", "normal").inc(4)
    gateway.admission_rejections.labels("503", "cluster_full", "b", "normal").inc(50)
    for _ in range(16):
        gateway.ttft_s.labels("model-a", "normal").observe(0.2)  # a's served requests: on time
        gateway.ttft_s.labels("model-b", "normal").observe(5.0)  # b's: all late
    text = generate_latest(gateway.registry).decode()
    worker = WorkerMetrics()
    worker.finished.labels("stop", "normal").inc(16)
    kwargs = {"time_s": 0.0, "window_s": 10.0, "desired_replicas": 1, "pods": RolePods(1)}

    def observed(router: Metrics) -> object:
        targets = Targets([parse(worker_text(worker), WORKER_FAMILIES)], [router])
        return observe_role("colocated", targets=targets, slo=SLO, **kwargs)  # type: ignore[arg-type]

    own = parse(text, ROUTER_FAMILIES, gateway_match("a", "model-a"))
    assert own.counters[ROUTER_SHED] == 4
    assert own.histograms["kvflow_router_ttft_seconds"].count == 16
    obs = observed(own)
    assert obs.request_rate_per_s == pytest.approx(2.0)  # (16 served + 4 refused) / 10 s
    assert obs.ttft_violation_fraction == pytest.approx(0.2)  # the 4 refused of 20
    everything = observed(parse(text, ROUTER_FAMILIES))  # what reading it whole would say
    assert everything.request_rate_per_s == pytest.approx(7.0)
    assert everything.ttft_violation_fraction == pytest.approx((16 + 54) / (32 + 54))
    # A pool the gateway fronts that refused nothing reads 0 refusals, not unknown.
    quiet = RouterMetrics()
    quiet.admission_pool("a")
    calm = parse(generate_latest(quiet.registry).decode(), ROUTER_FAMILIES, gateway_match("a", "m"))
    assert calm.counters[ROUTER_SHED] == 0.0


def test_roles_read_only_what_they_do_and_nothing_read_is_none() -> None:
    m = WorkerMetrics()
    m.tpot.labels("normal").observe(0.05)
    m.queue_wait.labels("normal").observe(0.3)
    targets = Targets(workers=[parse(worker_text(m), WORKER_FAMILIES)], routers=[])
    kwargs = {"time_s": 0.0, "window_s": 5.0, "desired_replicas": 1, "pods": RolePods(1)}
    decode = observe_role("decode", targets=targets, slo=SLO, **kwargs)  # type: ignore[arg-type]
    prefill = observe_role("prefill", targets=targets, slo=SLO, **kwargs)  # type: ignore[arg-type]
    assert decode.tpot_s is not None and decode.prefill_queue_wait_s is None
    assert decode.ttft_s is None
    assert prefill.tpot_s is None and prefill.prefill_queue_wait_s == pytest.approx(0.3)
    assert prefill.mean_input_tokens is None  # no finished request: no mean, and
    assert prefill.request_rate_per_s == 0.0  # a rate of zero is a measurement
    blind = observe_role(
        "decode",
        targets=Targets(workers=[], routers=[]),
        slo=SLO,
        **kwargs,  # type: ignore[arg-type]
    )
    assert blind.request_rate_per_s is None and blind.tpot_s is None and blind.kv_usage is None
    assert blind.num_waiting_requests is None


def pod(name: str, role: str, *, ready: bool, ip: str = "", unschedulable: bool = False) -> dict:  # type: ignore[type-arg]
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    component = "router" if role == "router" else "worker"
    return {
        "metadata": {
            "name": name,
            "labels": {"kvflow.io/role": role, "app.kubernetes.io/component": component},
        },
        "status": {"podIP": ip, "conditions": conditions},
    }


def test_pods_counted_per_role_with_their_metrics_urls() -> None:
    terminating = pod("d-old", "decode", ready=True, ip="10.0.0.9")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pods = classify(
        [
            pod("d-1", "decode", ready=True, ip="10.0.0.2"),
            pod("d-2", "decode", ready=False, ip="10.0.0.3"),
            pod("d-3", "decode", ready=False, unschedulable=True),
            pod("p-1", "prefill", ready=True, ip="fd00::5"),
            pod("r-1", "router", ready=True, ip="10.0.0.4"),
            terminating,
        ]
    )
    assert pods.roles["decode"] == RolePods(1, 2, 1, ("http://10.0.0.2:9400/metrics",))
    assert pods.roles["prefill"].targets == ("http://[fd00::5]:9400/metrics",)
    assert pods.router_targets == ("http://10.0.0.4:9401/metrics",)
    assert pods.gateway_targets == ()


def test_the_routers_of_gateways_in_front_of_the_pool_are_read_apart() -> None:
    """Gateway pods (listed by their fronts.kvflow.io/<pool> label) are routers the planner
    reads for this pool's series only: ready ones with an address, not terminating."""
    leaving = pod("gw-old", "router", ready=True, ip="10.0.1.9")
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    gateways = [
        pod("gw-1", "router", ready=True, ip="10.0.1.2"),
        pod("gw-2", "router", ready=False, ip="10.0.1.3"),
        pod("gw-3", "router", ready=True),  # no address yet
        leaving,
    ]
    pods = classify([pod("r-1", "router", ready=True, ip="10.0.0.4")], gateways)
    assert pods.router_targets == ("http://10.0.0.4:9401/metrics",)
    assert pods.gateway_targets == ("http://10.0.1.2:9401/metrics",)
    assert pods.roles == {}  # a gateway is no worker of the pool


def test_metrics_record_defaults_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.counters["x"] = 1
    assert b.counters == {}
