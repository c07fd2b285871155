"""The planner's Prometheus source against a real Prometheus scraping real processes.

Two simulated workers and a gateway run as real `kvflow` processes under a steady
closed-loop load; a real Prometheus (built from its Go module by tools/k8s/build.sh,
with promtool) scrapes their /metrics every second with the labels the chart's
PodMonitors add (namespace, pool, role). Over the same window, the planner's two sources
must agree on every input: direct scrapes (`scraped_targets`, what the operator does with
no Prometheus) and PromQL over the HTTP API (`query_targets`). Then the ways Prometheus
can fail the planner: nothing listening, something that is not Prometheus, a Prometheus
that does not scrape the pool.

No binary is a failure, never a skip: .ci/run builds it.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from k8s.controlplane import cache_dir, read_versions
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.operator.api.schema import from_json
from kvflow.operator.api.v1alpha1 import InferencePoolSpec
from kvflow.operator.builders.names import PoolRef
from kvflow.operator.observe.exposition import Histogram, Metrics, parse, window
from kvflow.operator.observe.histograms import total
from kvflow.operator.observe.observation import (
    ROUTER_FAMILIES,
    ROUTER_TTFT,
    WORKER_FAMILIES,
    WORKER_TPOT,
)
from kvflow.operator.observe.pods import PoolPods, RolePods
from kvflow.operator.observe.prometheus import PrometheusError
from kvflow.operator.observe.scrape import fetch_all
from kvflow.operator.planner.types import Observation
from kvflow.operator.planning import query_targets
from kvflow.operator.planning_inputs import observations_of, scraped_targets

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
POOL = PoolRef(name="chat", namespace="team-a", uid="u")
# 15 s windows: Prometheus' window ends at its last scrape and each end may sit up to one
# 1 s scrape from the direct reads', so counts differ by at most ~2/15 of a window.
WINDOW_S = 15.0
STREAMS = 6
OUTPUT_TOKENS = 24
SPEC = from_json(
    InferencePoolSpec,
    {
        "model": {"servedName": MODEL},
        "colocated": {"replicas": 2, "maxReplicas": 4},
        # Targets inside the load's distributions, so violation shares are not all 0 or 1.
        "slo": {"ttftTargetMs": 100, "tpotTargetMs": 8, "percentile": 90},
        "autoscaling": {"enabled": True, "prometheus": {"url": "http://unused"}},
    },
)


def prometheus_binary() -> Path:
    """The cached prometheus; a failing test, never a skip, when it was not built."""
    version = read_versions()["PROMETHEUS_VERSION"]
    path: Path = cache_dir() / f"prometheus-{version}" / "bin" / "prometheus"
    assert path.exists(), f"{path} missing: build it with tools/k8s/build.sh (.ci/run does)"
    return path


def scrape_config(workers: list[str], router: str) -> str:
    """Static targets with the labels the chart's PodMonitors give pods."""
    return f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: kvflow-worker
    static_configs:
      - targets: [{", ".join(workers)}]
        labels: {{namespace: {POOL.namespace}, pool: {POOL.name}, role: colocated}}
  - job_name: kvflow-router
    static_configs:
      - targets: [{router}]
        labels: {{namespace: {POOL.namespace}, pool: {POOL.name}}}
"""


class Prometheus:
    def __init__(self, binary: Path, workdir: Path, config: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (workdir / "prometheus.yml").write_text(config)
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [str(binary), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.workdir = workdir

    def query(self, q: str) -> list[dict[str, object]]:
        answer = httpx.post(f"{self.url}/api/v1/query", data={"query": q}, timeout=5).json()
        assert answer["status"] == "success", answer
        result: list[dict[str, object]] = answer["data"]["result"]
        return result

    def wait_scraping(self, targets: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.workdir / "prometheus.log").read_text()
            try:
                if len(self.query('up{pool="chat"} == 1')) == targets:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError((self.workdir / "prometheus.log").read_text()[-3000:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Load:
    """`STREAMS` closed-loop streaming completions through the gateway until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop_flag, self.errors = url, threading.Event(), list[str]()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, index: int) -> None:
        prompt = f"stream {index} " + "hello world " * 40
        body = {"model": MODEL, "prompt": prompt, "stream": True,
                "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS}  # fmt: skip
        with httpx.Client(timeout=30) as client:
            while not self.stop_flag.is_set():
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"HTTP {r.status_code}")
                        for _ in r.iter_lines():
                            pass
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PoolPods, Prometheus]]:
    binary = prometheus_binary()
    # 3 ms a step plus 0.5 ms per token in it, at most two requests running per worker:
    # six streams on two workers keep about two running and one queued on each, so the
    # queue wait, the waiting gauge and TTFT (queueing included) are all well above zero.
    sim = ["--simulate", "--served-model-name", MODEL, "--max-num-seqs", "2",
           "--sim-base-step-ms", "3", "--sim-per-token-ms", "0.5"]  # fmt: skip
    workers: list[WorkerProcess] = []
    gateway: GatewayProcess | None = None
    prometheus: Prometheus | None = None
    load: Load | None = None
    try:
        with ThreadPoolExecutor(2) as starting:  # each start takes seconds: side by side
            workers = list(starting.map(lambda _: launch_worker(sim, timeout_s=120), range(2)))
        gateway = launch_gateway(["--served-model-name", MODEL, "--metrics-port", "0",
                                  "--workers", ",".join(w.address for w in workers)])  # fmt: skip
        gateway.wait_ready(num_workers=2)
        worker_targets = [f"127.0.0.1:{w.metrics_port}" for w in workers]
        router_target = f"127.0.0.1:{gateway.ready_fields()['metrics_port']}"
        prometheus = Prometheus(
            binary,
            tmp_path_factory.mktemp("prometheus"),
            scrape_config(worker_targets, router_target),
        )
        prometheus.wait_scraping(targets=3)
        load = Load(gateway.url)
        # Steady state; the windows both sources read start after this (Prometheus has
        # been scraping since before the load, so its window is full).
        time.sleep(3)
        pods = PoolPods(
            roles={
                "colocated": RolePods(
                    2, 0, 0, tuple(f"http://{t}/metrics" for t in worker_targets)
                ),
            },
            router_targets=(f"http://{router_target}/metrics",),
        )
        yield pods, prometheus
        assert not load.errors, load.errors[:5]
    finally:
        if load is not None:
            load.stop()
        if prometheus is not None:
            prometheus.stop()
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop(timeout_s=10)


async def direct_read(pods: PoolPods) -> dict[str, Metrics]:
    bodies = await fetch_all([*pods.roles["colocated"].targets, *pods.router_targets])
    return {
        url: parse(text, ROUTER_FAMILIES if url in pods.router_targets else WORKER_FAMILIES)
        for url, text in bodies.items()
    }


def both_sources(
    pods: PoolPods, prometheus: Prometheus
) -> tuple[Observation, Observation, dict[str, Histogram]]:
    """The colocated role's observation from each source over the same WINDOW_S, and the
    buckets its TTFT (the gateway's) and TPOT (the workers') come from."""

    async def read() -> tuple[Observation, Observation, dict[str, Histogram]]:
        before = await direct_read(pods)
        t0 = time.monotonic()
        await asyncio.sleep(WINDOW_S)
        after = await direct_read(pods)
        window_s = time.monotonic() - t0
        prom = await query_targets(prometheus.url, SPEC, POOL, window_s, pods)
        assert len(after) == 3, "every process answered /metrics"
        windows = {url: window(m, before.get(url)) for url, m in after.items()}
        direct = scraped_targets(SPEC, pods, windows)
        by_prom = observations_of(SPEC, POOL, pods, {}, prom, 0.0, window_s)
        by_scrape = observations_of(SPEC, POOL, pods, {}, direct, 0.0, window_s)
        targets = direct["colocated"]
        ttft = total(m.histograms[ROUTER_TTFT] for m in targets.routers)
        tpot = total(m.histograms[WORKER_TPOT] for m in targets.workers)
        assert ttft is not None and tpot is not None
        return by_scrape["colocated"], by_prom["colocated"], {"ttft_s": ttft, "tpot_s": tpot}

    return asyncio.run(read())


def bucket_width(h: Histogram, value: float) -> float:
    """Width of the bucket holding `value`: both sources interpolate in the same buckets."""
    lower = 0.0
    for bound in h.bounds:
        if value <= bound:
            return bound - lower if not math.isinf(bound) else math.inf
        lower = bound
    return math.inf


def test_prometheus_and_direct_scrapes_agree_on_every_input(
    served: tuple[PoolPods, Prometheus],
) -> None:
    pods, prometheus = served
    scrape, prom, buckets = both_sources(pods, prometheus)
    print(f"direct:     {scrape}\nprometheus: {prom}")
    # Every input measured by both (the load reaches every part the planner reads).
    for name in ("request_rate_per_s", "mean_input_tokens", "mean_output_tokens", "ttft_s",
                 "tpot_s", "ttft_violation_fraction", "tpot_violation_fraction",
                 "prefill_queue_wait_s", "decode_batch_size", "kv_usage",
                 "num_waiting_requests"):  # fmt: skip
        assert getattr(scrape, name) is not None and getattr(prom, name) is not None, name
    assert scrape.request_rate_per_s and prom.request_rate_per_s
    assert scrape.request_rate_per_s > 5  # a load worth comparing
    # Counts over windows that differ by up to a scrape at each end (2 of 15 s) plus
    # Prometheus' extrapolation to the window's edges.
    assert prom.request_rate_per_s == pytest.approx(scrape.request_rate_per_s, rel=0.15)
    # Per-request means: ratios of counters over the same window, fixed-length requests
    # (in-flight requests at the edges count prompt tokens before they finish).
    assert prom.mean_output_tokens == pytest.approx(scrape.mean_output_tokens, rel=0.05)
    assert prom.mean_output_tokens == pytest.approx(OUTPUT_TOKENS, rel=0.05)
    assert prom.mean_input_tokens == pytest.approx(scrape.mean_input_tokens, rel=0.1)
    # Percentiles of nearly the same requests, interpolated in the same buckets: at most
    # one bucket apart (the workers' and routers' buckets are 5-50 ms wide here).
    for name in ("ttft_s", "tpot_s"):
        a, b = getattr(scrape, name), getattr(prom, name)
        width = max(bucket_width(buckets[name], a), bucket_width(buckets[name], b))
        assert abs(a - b) <= width, (name, a, b)
    for name in ("ttft_violation_fraction", "tpot_violation_fraction"):
        assert getattr(prom, name) == pytest.approx(getattr(scrape, name), abs=0.1), name
    assert prom.prefill_queue_wait_s == pytest.approx(
        scrape.prefill_queue_wait_s, abs=0.005, rel=0.3
    )
    # Gauges read up to a second apart under a closed loop of STREAMS requests.
    assert prom.decode_batch_size == pytest.approx(scrape.decode_batch_size, abs=STREAMS / 4)
    assert prom.kv_usage == pytest.approx(scrape.kv_usage, abs=0.02, rel=0.5)
    # The queue of a closed loop moves within a scrape interval: on two busy cores it went
    # from 3 to 0 between Prometheus' last scrape and the direct read.
    assert prom.num_waiting_requests == pytest.approx(scrape.num_waiting_requests, abs=STREAMS / 2)


def test_what_prometheus_cannot_answer_is_an_error_that_says_why(
    served: tuple[PoolPods, Prometheus],
) -> None:
    pods, prometheus = served

    def failure(url: str, pool: PoolRef = POOL) -> str:
        with pytest.raises(PrometheusError) as caught:
            asyncio.run(query_targets(url, SPEC, pool, WINDOW_S, pods))
        return str(caught.value)

    closed = f"http://127.0.0.1:{free_port()}"
    assert closed in failure(closed)
    worker_metrics = pods.roles["colocated"].targets[0].removesuffix("/metrics")
    assert "not a Prometheus API answer" in failure(worker_metrics)
    other = PoolRef(name="not-scraped", namespace=POOL.namespace, uid="u")
    message = failure(prometheus.url, other)
    assert "no kvflow_worker series" in message and "'not-scraped'" in message
