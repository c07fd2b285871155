"""The planner does not scale up for batch work alone (docs/planner.md, "Batch work").

The same heavy load, exported by real worker and router metrics classes and read as the
operator reads a scrape (exposition.parse with the batch series dropped, then
observe_role), asks for more replicas in the normal class and for none in the batch class:
a batch queued behind online work fills spare capacity, it is not a lack of replicas.
"""

from __future__ import annotations

from planner.history import TPOT_S, TTFT_S, Run, config
from prometheus_client import generate_latest

from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.operator.observe.exposition import Metrics, parse
from kvflow.operator.observe.observation import (
    OFFLINE_SERIES,
    ROUTER_FAMILIES,
    WORKER_FAMILIES,
    Slo,
    Targets,
    observe_role,
)
from kvflow.operator.observe.pods import RolePods
from kvflow.operator.planner import CapacityProfile, Decision, Observation
from kvflow.router.metrics import RouterMetrics

WINDOW_S = 30.0
REPLICAS = 2
# One replica serves 5,000 prompt and 1,000 output tokens/s within the SLO.
CAPACITY = CapacityProfile(5000.0, 1000.0, source="test")
SLO = Slo(TTFT_S, TPOT_S, percentile=90)


def _load(
    cls: str, *, requests: int, waiting: int, kv: float, late: bool
) -> tuple[WorkerMetrics, RouterMetrics]:
    """One worker's window of `requests` in class `cls` (every one late when `late`), and
    the router that sent them."""
    worker, router = WorkerMetrics(), RouterMetrics()
    worker.finished.labels("length", cls).inc(requests)
    worker.prompt_tokens.labels(cls).inc(requests * 1000)
    worker.generation_tokens.labels(cls).inc(requests * 200)
    worker.running.labels(cls).set(16)
    worker.waiting.labels(cls).set(waiting)
    worker.kv_class_usage.labels(cls).set(kv)
    worker.kv_usage.set(kv)
    ttft_s, tpot_s, wait_s = (5.0, 0.3, 4.0) if late else (0.1, 0.01, 0.0)
    for _ in range(requests):
        worker.ttft.labels(cls).observe(ttft_s)
        worker.tpot.labels(cls).observe(tpot_s)
        worker.queue_wait.labels(cls).observe(wait_s)
        router.ttft_s.labels("m", cls).observe(ttft_s)
        router.tpot_s.labels("m", cls).observe(tpot_s)
    return worker, router


def _read(*owners: WorkerMetrics | RouterMetrics) -> Metrics:
    """What the operator keeps of one scrape (planning.scrape): the batch series dropped."""
    text = "".join(generate_latest(o.registry).decode() for o in owners)
    families = ROUTER_FAMILIES if isinstance(owners[0], RouterMetrics) else WORKER_FAMILIES
    return parse(text, families, None, OFFLINE_SERIES)


def observe(*loads: tuple[WorkerMetrics, RouterMetrics]) -> Observation:
    """Each load on its own worker of one colocated pool of REPLICAS, one router."""
    workers = [_read(w) for w, _ in loads]
    routers = [_read(*(r for _, r in loads))]
    pods = RolePods(ready_replicas=REPLICAS)
    return observe_role("colocated", time_s=0.0, window_s=WINDOW_S,
                        desired_replicas=REPLICAS, pods=pods,
                        targets=Targets(workers, routers), slo=SLO)  # fmt: skip


def decide(obs: Observation) -> Decision:
    return Run(config("colocated", replicas=REPLICAS, capacity=CAPACITY)).step("colocated", obs)


def heavy(cls: str) -> tuple[WorkerMetrics, RouterMetrics]:
    """Twice what two replicas carry (40 requests/s of 1,000 prompt tokens), queues long,
    every request late, the KV cache nearly full."""
    return _load(cls, requests=600, waiting=60, kv=0.97, late=True)


def light_normal() -> tuple[WorkerMetrics, RouterMetrics]:
    """A third of one replica's capacity, every request on time."""
    return _load("normal", requests=50, waiting=0, kv=0.1, late=False)


def test_a_heavy_normal_load_scales_up() -> None:
    obs = observe(heavy("normal"), heavy("normal"))
    assert obs.request_rate_per_s == 40.0
    assert obs.num_waiting_requests == 120
    decision = decide(obs)
    assert decision.replicas > REPLICAS


def test_the_same_load_in_the_batch_class_asks_for_no_replica() -> None:
    obs = observe(heavy("batch"), heavy("batch"))
    # Nothing of it is read: no online request came, none waits, no latency to judge.
    assert obs.request_rate_per_s == 0
    assert obs.num_waiting_requests == 0
    assert obs.kv_usage == 0
    assert obs.ttft_violation_fraction is None and obs.tpot_violation_fraction is None
    assert decide(obs).replicas <= REPLICAS


def test_batch_beside_online_work_sizes_for_the_online_work_alone() -> None:
    alone = decide(observe(light_normal(), light_normal()))
    beside = observe(heavy("batch"), light_normal())
    assert beside.request_rate_per_s == 50 / WINDOW_S
    assert decide(beside).replicas == alone.replicas <= REPLICAS
