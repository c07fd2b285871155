"""The planner benchmark's elastic cluster and scrape: workers start late and drain."""

from __future__ import annotations

import dataclasses
import random

from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.router.serving.admission import AdmissionConfig
from kvflow.sim.arms import resolve_arm
from kvflow.sim.autoscale_cluster import ElasticCluster
from kvflow.sim.autoscale_observe import percentile, sample
from kvflow.sim.autoscale_traffic import Traffic, requests_for
from kvflow.sim.cluster import ClusterSpec

PROFILE = dataclasses.replace(
    named_profile("h100-llama3-8b"),  # type: ignore[arg-type]
    max_num_seqs=8,
    max_num_batched_tokens=512,
)
TRAFFIC = Traffic("step", 60, 10.0, input_tokens=(32, 64), output_tokens=(4, 8))


def _cluster(
    workers: int = 1, startup_s: float = 20.0, traffic: Traffic = TRAFFIC
) -> ElasticCluster:
    cluster = ElasticCluster(
        ClusterSpec(PROFILE, num_workers=workers), resolve_arm("kvflow"), startup_s=startup_s
    )
    rng = random.Random(0)
    times = [i * 0.2 for i in range(300)]  # 5 req/s for 60 s
    for request, at_s in requests_for(times, traffic, rng, "t"):
        cluster.submit(request, at_s)
    return cluster


def test_new_workers_serve_only_after_their_start_up() -> None:
    cluster = _cluster(startup_s=20.0)
    seen: list[tuple[int, int, int]] = []
    cluster.events.at(5.0, lambda: cluster.scale_to(3))
    for t in (6.0, 24.9, 25.1):
        cluster.events.at(t, lambda: seen.append(
            (cluster.num_desired, cluster.num_ready, cluster.num_holding_gpus)))  # fmt: skip
    records = cluster.run()
    assert seen == [(3, 1, 3), (3, 1, 3), (3, 3, 3)]
    new = [r for r in records if r.worker in ("sim-1", "sim-2")]
    assert new and min(r.sent_s for r in new) >= 25.0
    assert cluster.num_scale_events == 1


def test_removed_workers_drain_then_leave_and_starting_ones_go_first() -> None:
    # Outputs of 400-800 tokens (several seconds each): sim-2 holds requests when removed.
    long = dataclasses.replace(TRAFFIC, output_tokens=(400, 800))
    cluster = _cluster(workers=3, startup_s=30.0, traffic=long)
    seen: list[tuple[float, int, int, int, bool]] = []

    def note() -> None:
        now = cluster.events.now_s
        counts = (cluster.num_desired, cluster.num_ready, cluster.num_holding_gpus)
        seen.append((now, *counts, "sim-2" in cluster.workers))

    cluster.events.at(10.0, lambda: cluster.scale_to(4))  # sim-3 starts, ready at 40 s
    cluster.events.at(20.0, lambda: cluster.scale_to(2))  # cancels sim-3, drains sim-2
    for t in (20.0, 45.0, 120.0):
        cluster.events.at(t, note)
    records = cluster.run()
    # Draining: out of the desired and ready counts, still holding its GPU and its work.
    assert seen[0] == (20.0, 2, 2, 3, True)
    assert seen[-1] == (120.0, 2, 2, 2, False)  # done and gone
    assert "sim-3" not in cluster.workers  # the starting pod was cancelled, never served
    assert not [r for r in records if r.worker == "sim-3"]
    assert not [r for r in records if r.worker == "sim-2" and r.sent_s > 20.0]
    assert [r for r in records if r.worker == "sim-2" and r.end_s > 20.0]  # it finished them


def test_scrape_reads_rates_latencies_and_pods() -> None:
    cluster = _cluster(startup_s=50.0)
    scrapes = []
    cluster.events.at(1.0, lambda: cluster.scale_to(2))
    cluster.events.at(
        30.0,
        lambda: scrapes.append(
            sample(
                cluster, window_s=20.0, percentile_pct=90, ttft_target_s=0.001, tpot_target_s=1.0
            )
        ),
    )
    cluster.run()
    obs = scrapes[0].observation
    assert obs.time_s == 30.0
    assert (obs.desired_replicas, obs.ready_replicas, obs.pending_replicas) == (2, 1, 1)
    assert obs.request_rate_per_s == 5.0  # 100 arrivals in (10, 30]
    assert obs.mean_input_tokens is not None and 32 <= obs.mean_input_tokens <= 64
    assert obs.ttft_s is not None and obs.ttft_s > 0.001
    assert obs.ttft_violation_fraction == 1.0  # every TTFT is over a 1 ms target
    assert obs.tpot_violation_fraction == 0.0
    assert obs.kv_usage is not None and obs.decode_batch_size is not None
    assert obs.prefill_queue_wait_s is not None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 90) == 9.0
    assert percentile(values, 91) == 10.0
    assert percentile([], 90) is None


def test_a_worker_removed_between_its_step_and_the_step_s_end_keeps_its_last_outputs() -> None:
    # At 20.0493 s sim-2's engine has computed a step that finishes a request (its queues
    # are empty) whose tokens reach the client only when the step ends; dropping the worker
    # then lost them (KeyError on the router's count). Found by sweeping the drain time.
    cluster = _cluster(workers=3, startup_s=30.0)
    cluster.events.at(20.0493, lambda: cluster.scale_to(2))
    records = cluster.run()
    assert len(records) == 300 and all(r.is_ok for r in records)
    assert "sim-2" not in cluster.workers


def _overloaded(admission: AdmissionConfig | None, output_tokens: tuple[int, int]) -> list:  # type: ignore[type-arg]
    cluster = ElasticCluster(
        ClusterSpec(PROFILE, num_workers=1, admission=admission),
        resolve_arm("kvflow"),
        startup_s=0.0,
    )
    traffic = dataclasses.replace(TRAFFIC, output_tokens=output_tokens)
    times = [i * 0.2 for i in range(300)]  # 5 req/s for 60 s
    for request, at_s in requests_for(times, traffic, random.Random(0), "t"):
        cluster.submit(request, at_s)
    records = cluster.run()
    assert len(cluster.refusals) == sum(r.error == "http_503" for r in records)
    return records


def test_admission_control_refuses_what_would_queue_past_its_bound() -> None:
    """The gateway's admission core (router serving/admission.py) in virtual time: one
    worker past its capacity. Without it every request queues and the wait grows
    with the run; with a 1 s bound the excess gets 503 at once and the admitted start
    within about the bound."""
    busy = (250, 350)  # 5 req/s of 300-token answers: about 1.3x what 8 sequences hold
    unbounded = _overloaded(None, busy)
    bounded = _overloaded(AdmissionConfig(shed_queue_time_s=1.0, max_queue_time_s=1.0), busy)
    assert all(r.is_ok for r in unbounded)
    late = sorted(r.ttft_s for r in unbounded if r.ttft_s is not None)
    assert late[-1] > 10.0  # the queue grew for the whole minute
    refused = [r for r in bounded if r.error == "http_503"]
    served = sorted(r.ttft_s for r in bounded if r.ttft_s is not None)
    assert 0.1 * len(bounded) < len(refused) < 0.5 * len(bounded)
    assert all("cluster_full" in r.error_detail for r in refused)
    assert served[int(0.99 * len(served))] < 2.0
    light = _overloaded(AdmissionConfig(shed_queue_time_s=1.0, max_queue_time_s=1.0), (4, 8))
    assert all(r.is_ok for r in light)  # under capacity nothing is refused
