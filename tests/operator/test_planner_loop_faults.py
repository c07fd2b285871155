"""What the planner does when its inputs fail it (planning.py, observe/): a missed scrape is
no burst, targets it could not read hold a scale-down, work still running is not idleness,
a malformed page is a failed read (never the end of planning), and a pool it no longer
plans leaves no series behind. On the real PlanningLoop (testkit/planner_cluster.py)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from testkit.planner_cluster import INTERVAL_S, PlannerCluster, pool_body

from kvflow.operator.observe.exposition import ExpositionError, parse
from kvflow.proto import metric_names as n

PROFILE = {"replicaPromptTokensPerSecond": 20000, "replicaDecodeTokensPerSecond": 4000}
STEADY = int(7 * INTERVAL_S)  # 7 requests a second per worker: 4 replicas carry it


def test_a_missed_scrape_is_not_a_burst_of_a_pods_whole_life(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that missed one read had no baseline at the next: its counts since it
    started (a day of traffic) were one window's, and a steady pool went to maxReplicas."""
    cluster = PlannerCluster(pool_body(**PROFILE), monkeypatch)
    for worker in cluster.workers.values():
        worker.serve(7 * 86400, observed=100)  # a day at 7 requests a second
    late = "http://10.0.0.3:9400/metrics"
    rates = []
    for i in range(12):
        for worker in cluster.workers.values():
            worker.serve(STEADY)
        cluster.down = {late} if i == 5 else set()
        if cluster.interval() is not None:
            rates.append(cluster.input("request_rate_per_s"))
        assert cluster.replicas <= 4, (i, rates)
    # Where it was not read, or had no baseline, it is taken to carry what the others do.
    assert rates == pytest.approx([28.0] * len(rates))


def test_workers_not_read_count_as_the_read_ones_and_most_unread_hold_a_scale_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three of four scrapes time out: the load of the one read is not the pool's."""
    cluster = PlannerCluster(pool_body(**PROFILE), monkeypatch)
    urls = list(cluster.workers)
    outcome = None
    for i in range(14):
        for worker in cluster.workers.values():
            worker.serve(STEADY)
        cluster.down = set(urls[1:]) if i >= 3 else set()
        outcome = cluster.interval()
        assert cluster.replicas == 4, (i, outcome)
    assert outcome is not None
    assert "3 of 4 workers unread" in outcome.decisions[0].message
    assert cluster.input("num_unread_workers") == 3
    assert cluster.input("request_rate_per_s") == pytest.approx(28.0)  # 7 a second, x 4


@pytest.mark.parametrize("min_replicas", [1, 0])
def test_requests_running_and_queued_are_not_idleness(
    monkeypatch: pytest.MonkeyPatch, min_replicas: int
) -> None:
    """Nothing finishes for six minutes (long answers): 48 running, 24 queued."""
    colocated = {"replicas": 4, "minReplicas": min_replicas, "maxReplicas": 8}
    cluster = PlannerCluster(pool_body(colocated), monkeypatch)
    for worker in cluster.workers.values():
        worker.serve(500)
        worker.running.labels("normal").set(12)
        worker.waiting.labels("normal").set(6)
    for i in range(13):
        cluster.interval()
        assert cluster.replicas == 4, i
    assert cluster.input("num_running_requests") == 48


def test_a_malformed_page_is_a_failed_read_and_planning_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = PlannerCluster(pool_body(), monkeypatch)
    broken = "http://10.0.0.4:9400/metrics"
    ttft = n.WORKER_TTFT
    decided = 0
    for i in range(6):
        for worker in cluster.workers.values():
            worker.serve(300, ttft_s=3.0, tpot_s=0.3)  # the SLO broken: a decision each time
        if i >= 2:  # a bucket without `le`, as a foreign exporter or a proxy might write
            page = cluster.workers[broken].page()
            cluster.pages[broken] = page.replace(
                f"# TYPE {ttft} histogram\n", f"# TYPE {ttft} histogram\n{ttft}_bucket{{}} 0\n"
            )
        decided += cluster.interval() is not None
    assert decided == 5  # every interval after the first read
    assert cluster.metrics.scrape_failures.labels("ns", "p")._value.get() == 4
    for text in (f'{ttft}_bucket{{le="abc"}} 1\n', f"{ttft}_bucket{{}} 0\n", "",
                 "<html>Not here</html>\n"):  # fmt: skip
        with pytest.raises(ExpositionError):
            parse(f"# TYPE {ttft} histogram\n{text}" if "bucket" in text else text, {ttft})


def test_a_pool_no_longer_planned_leaves_no_series(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = PlannerCluster(pool_body(), monkeypatch)
    for _ in range(3):
        for worker in cluster.workers.values():
            worker.serve(300)
        cluster.interval()

    def series() -> list[str]:
        text = generate_latest(cluster.metrics.registry).decode()
        return [line for line in text.splitlines() if 'pool="p"' in line]

    assert any(line.startswith("kvflow_operator_planner_slo_met") for line in series())
    cluster.kube.bodies[0]["spec"]["autoscaling"]["enabled"] = False
    cluster.interval()
    assert series() == []
    cluster.kube.bodies[0]["spec"]["autoscaling"]["enabled"] = True
    for _ in range(3):
        for worker in cluster.workers.values():
            worker.serve(300)
        cluster.interval()
    assert series()
    cluster.kube.bodies.clear()  # the pool deleted
    cluster.interval()
    assert series() == []
