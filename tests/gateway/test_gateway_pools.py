"""One gateway in front of two pools, as an InferenceGateway runs it: each pool's admission
control refuses for its own pool, and each pool's planner, reading the gateway's real
/metrics as the operator does, counts its own refusals and served requests only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.gateway_process import launch_gateway
from testkit.scrape import sample
from testkit.sim_overload import MODEL, body, post_all, sim_args
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.operator.observe.pods import PoolPods
from kvflow.operator.planning import scrape
from kvflow.proto.metric_names import ROUTER_SHED, ROUTER_TTFT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALM_MODEL = "sim-calm"  # the second pool's


@pytest.fixture
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(sim_args(MODEL), timeout_s=120)
    yield w
    w.stop(timeout_s=10)


@pytest.fixture
def calm_worker() -> Iterator[WorkerProcess]:
    w = launch_worker(sim_args(CALM_MODEL), timeout_s=120)
    yield w
    w.stop(timeout_s=10)


def test_a_gateway_of_two_pools_counts_each_pools_refusals_for_its_planner(
    worker: WorkerProcess, calm_worker: WorkerProcess, tmp_path: Path
) -> None:
    """One gateway in front of two pools (as an InferenceGateway runs it): the busy pool's
    admission control sheds, and its refusals carry `pool="busy"`. Each pool's planner,
    reading the gateway's real /metrics as the operator does (`planning.scrape`), counts
    its own refusals and served requests and none of the other pool's."""
    config = {"pools": [
        {"name": "busy", "served_model_name": MODEL, "workers": [worker.address]},
        {"name": "calm", "served_model_name": CALM_MODEL, "workers": [calm_worker.address]},
    ]}  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    flags = ["--admission-shed-queue-time-s", "0.5", "--admission-max-queue-time-s", "1",
             "--admission-poll-interval-s", "0.1"]  # fmt: skip
    gateway = launch_gateway(["--config", str(path), *flags])
    try:
        gateway.wait_ready(num_workers=2)
        calm_body = body(5, CALM_MODEL)

        async def waves() -> tuple[list[httpx.Response], list[httpx.Response]]:
            first, second, calm = await asyncio.gather(
                post_all(gateway.url, [body(20) for _ in range(6)]),
                post_all(gateway.url, [body(20) for _ in range(20)], delay_s=1.5),
                post_all(gateway.url, [calm_body for _ in range(3)], delay_s=1.5),
            )
            return [*first, *second], calm

        busy, calm = asyncio.run(waves())
        assert all(r.status_code == 200 for r in calm), [r.text for r in calm]
        refused = [r for r in busy if r.status_code == 503]
        served = [r for r in busy if r.status_code == 200]
        assert refused and len(refused) + len(served) == len(busy)
        metrics = f"{gateway.url}/metrics"
        name = "kvflow_router_admission_rejections_total"
        assert sample(metrics, name, pool="busy") == len(refused)
        assert sample(metrics, name, pool="calm") == 0

        busy_reads, failures = asyncio.run(
            scrape(PoolPods(gateway_targets=(metrics,)), "busy", MODEL)
        )
        assert failures == 0
        assert busy_reads[metrics].counters[ROUTER_SHED] == len(refused)
        assert busy_reads[metrics].histograms[ROUTER_TTFT].count == len(served)
        calm_reads, _ = asyncio.run(
            scrape(PoolPods(gateway_targets=(metrics,)), "calm", CALM_MODEL)
        )
        assert calm_reads[metrics].counters[ROUTER_SHED] == 0
        assert calm_reads[metrics].histograms[ROUTER_TTFT].count == len(calm)
    finally:
        gateway.stop()
