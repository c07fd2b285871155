"""The planner's direct scrape over real HTTP: a pool's own router counts whole, a gateway's
router in front of two pools counts only this pool's series, and a target that does not
answer is a failure, not a zero.

The /metrics pages are served by prometheus_client's own HTTP server from the router's
real metric class (`RouterMetrics`), as a router process serves them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import start_http_server
from testkit.ports import free_port

from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.operator.observe.pods import PoolPods, RolePods
from kvflow.operator.planning import scrape
from kvflow.proto import metric_names as names
from kvflow.proto.metric_names import ROUTER_SHED
from kvflow.router.metrics import RouterMetrics

TTFT = "kvflow_router_ttft_seconds"


def serve(metrics: RouterMetrics | WorkerMetrics) -> Iterator[str]:
    server, thread = start_http_server(0, "127.0.0.1", registry=metrics.registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join(5)


@pytest.fixture
def own_router() -> Iterator[str]:
    """Pool a's own router (one pool: every series is a's, whatever its `pool` label)."""
    metrics = RouterMetrics()
    metrics.admission_pool("default")
    metrics.admission_rejections.labels("503", "cluster_full", "default", "normal").inc(2)
    for _ in range(3):
        metrics.ttft_s.labels("model-a", "normal").observe(0.1)
    yield from serve(metrics)


@pytest.fixture
def gateway_router() -> Iterator[str]:
    """An InferenceGateway's router in front of pools a and b."""
    metrics = RouterMetrics()
    for pool in ("a", "b"):
        metrics.admission_pool(pool)
    metrics.admission_rejections.labels("503", "cluster_full", "a", "normal").inc(5)
    metrics.admission_rejections.labels("429", "over_share", "b", "normal").inc(40)
    for _ in range(7):
        metrics.ttft_s.labels("model-a", "normal").observe(0.2)
    for _ in range(30):
        metrics.ttft_s.labels("model-b", "normal").observe(9.0)
    yield from serve(metrics)


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}/metrics"


def test_a_gateways_router_counts_only_the_pools_own_series(
    own_router: str, gateway_router: str
) -> None:
    pods = PoolPods(router_targets=(own_router,), gateway_targets=(gateway_router,))
    reads, failures = asyncio.run(scrape(pods, "a", "model-a"))
    assert failures == 0
    assert reads[own_router].counters[ROUTER_SHED] == 2
    assert reads[own_router].histograms[TTFT].count == 3
    assert reads[gateway_router].counters[ROUTER_SHED] == 5  # not b's 40
    assert reads[gateway_router].histograms[TTFT].count == 7  # not b's 30 slow ones
    # Pool b's planner reads the same gateway the other way round.
    reads, _ = asyncio.run(scrape(PoolPods(gateway_targets=(gateway_router,)), "b", "model-b"))
    assert reads[gateway_router].counters[ROUTER_SHED] == 40
    assert reads[gateway_router].histograms[TTFT].count == 30


def test_a_gateway_router_that_does_not_answer_is_a_failure(own_router: str) -> None:
    pods = PoolPods(router_targets=(own_router,), gateway_targets=(closed_url(),))
    reads, failures = asyncio.run(scrape(pods, "a", "model-a"))
    assert failures == 1
    assert list(reads) == [own_router]


@pytest.fixture
def busy_with_batch() -> Iterator[tuple[str, str]]:
    """A worker and its router: a little normal work and a lot of batch work."""
    worker, router = WorkerMetrics(), RouterMetrics()
    router.admission_pool("default")
    for cls, n in (("normal", 3), ("batch", 50)):
        worker.finished.labels("length", cls).inc(n)
        worker.waiting.labels(cls).set(n)
        for _ in range(n):
            worker.ttft.labels(cls).observe(0.1 if cls == "normal" else 30.0)
            router.ttft_s.labels("model-a", cls).observe(0.1 if cls == "normal" else 30.0)
        router.admission_rejections.labels("503", "batch_shed", "default", cls).inc(n)
    worker_urls, router_urls = serve(worker), serve(router)
    yield next(worker_urls), next(router_urls)
    for urls in (worker_urls, router_urls):
        next(urls, None)  # shut the server down


def test_the_scrape_leaves_the_batch_class_out(busy_with_batch: tuple[str, str]) -> None:
    """The planner sizes for the online classes (docs/planner.md, "Batch work")."""
    worker_url, router_url = busy_with_batch
    pods = PoolPods(roles={"colocated": RolePods(1, targets=(worker_url,))},
                    router_targets=(router_url,))  # fmt: skip
    reads, failures = asyncio.run(scrape(pods, "a", "model-a"))
    assert failures == 0
    worker, router = reads[worker_url], reads[router_url]
    assert worker.counters[names.WORKER_FINISHED] == 3
    assert worker.gauges[names.WORKER_WAITING] == 3
    assert worker.histograms[names.WORKER_TTFT].count == 3
    assert router.histograms[TTFT].count == 3
    assert router.counters[ROUTER_SHED] == 3
