"""Priority classes with real processes: a simulated worker with a tiny KV cache and few
seats behind a real gateway with tenants. One tenant's batch flood fills the worker; its
realtime request still gets its first token at once (it preempts a batch request, which
recomputes and finishes), the response says the class applied, a tenant's ceiling caps
what it asks for, and an unknown word is a 400."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.scrape import sample
from testkit.sim_overload import MODEL
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto.metric_names import WORKER_WAITING
from kvflow.proto.priority_class import HEADER
from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# 10 ms a step, 4 seats, 40 blocks of 16 tokens: four batch requests of 200 tokens hold
# every seat for about 2 s and outgrow the cache near their end.
WORKER_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "10",
               "--max-num-seqs", "4", "--num-kv-blocks", "40"]  # fmt: skip
NUM_BATCH = 8
BATCH_TOKENS = 200
# A realtime request's answer within this, where without classes it waits behind the
# tenant's earlier batch requests (seconds: a seat frees after about 2 s).
REALTIME_WITHIN_S = 0.75
TENANTS = [
    {"name": "acme", "max_priority_class": "realtime"},  # its app sends both kinds
    {"name": "plain"},  # the default ceiling: normal
]


def key(name: str) -> str:
    return f"sk-{name}-0123456789"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(WORKER_ARGS, timeout_s=120)
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, worker: WorkerProcess
) -> Iterator[GatewayProcess]:
    tenants = [{**t, "api_key_sha256": hash_api_key(key(str(t["name"])))} for t in TENANTS]
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    # Admission off: this test is about the worker's scheduling (admission's shedding
    # order has its own tests, tests/router/test_priority_classes.py).
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--config", str(path), "--admission", "off"])  # fmt: skip
    g.wait_ready()
    yield g
    g.stop()


def body(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "ignore_eos": True, **extra}  # fmt: skip


def headers(tenant: str, **extra: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key(tenant)}", **extra}


def test_realtime_first_token_stays_fast_while_batch_fills_the_worker(
    gateway: GatewayProcess, worker: WorkerProcess
) -> None:
    url = f"{gateway.base_url}/chat/completions"
    metrics = f"http://127.0.0.1:{worker.metrics_port}/metrics"

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            batch_body = body(BATCH_TOKENS, priority_class="batch")
            flood = [
                asyncio.create_task(client.post(url, json=batch_body, headers=headers("acme")))
                for _ in range(NUM_BATCH)
            ]
            # Until the worker is full: every seat taken and batch requests waiting.
            deadline = time.monotonic() + 30
            while sample(metrics, WORKER_WAITING) < NUM_BATCH - 4:
                assert time.monotonic() < deadline, "the batch flood never filled the worker"
                await asyncio.sleep(0.02)
            started = time.monotonic()
            # OpenAI's service_tier "priority" is realtime; one token: the answer is the TTFT.
            realtime = await client.post(url, json=body(1, service_tier="priority"),
                                         headers=headers("acme"))  # fmt: skip
            elapsed_s = time.monotonic() - started
            return list(await asyncio.gather(*flood)), realtime, elapsed_s

    batch, realtime, elapsed_s = asyncio.run(scenario())
    assert realtime.status_code == 200, realtime.text
    assert realtime.headers[HEADER] == "realtime"
    assert elapsed_s < REALTIME_WITHIN_S, f"the realtime request took {elapsed_s:.2f} s"
    # It took a batch request's seat; that request recomputed and finished all the same.
    assert sample(metrics, "kvflow_worker_class_preemptions_total", victim_class="batch") >= 1
    assert sample(metrics, "kvflow_worker_class_preemptions_total", victim_class="realtime") == 0
    for r in batch:
        assert r.status_code == 200, r.text
        assert r.headers[HEADER] == "batch"
        assert r.json()["usage"]["completion_tokens"] == BATCH_TOKENS


def test_the_tenant_ceiling_caps_the_class_and_the_header_says_so(gateway: GatewayProcess) -> None:
    url = f"{gateway.base_url}/chat/completions"
    asked = httpx.post(url, json=body(1), headers=headers("plain", **{HEADER: "realtime"}),
                       timeout=60)  # fmt: skip
    assert asked.status_code == 200, asked.text
    assert asked.headers[HEADER] == "normal"
    # The body wins over the header.
    lower = httpx.post(url, json=body(1, priority_class="batch"),
                       headers=headers("acme", **{HEADER: "realtime"}), timeout=60)  # fmt: skip
    assert lower.headers[HEADER] == "batch"
    # Nothing asked: normal, as before classes.
    assert httpx.post(url, json=body(1), headers=headers("acme"), timeout=60).headers[HEADER] == (
        "normal"
    )


@pytest.mark.parametrize(
    ("extra_body", "extra_headers", "param", "says"),
    [
        ({"priority_class": "urgent"}, {}, "priority_class", "realtime, normal, batch"),
        ({"service_tier": "scale"}, {}, "service_tier", "realtime, normal, batch"),
        ({"priority_class": 1}, {}, "priority_class", "expected a string"),
        ({}, {HEADER: "asap"}, HEADER, "realtime, normal, batch"),
    ],
)
def test_an_unknown_class_is_a_400_naming_the_words(
    gateway: GatewayProcess, extra_body: dict[str, object], extra_headers: dict[str, str],
    param: str, says: str,
) -> None:  # fmt: skip
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=body(1, **extra_body),
                   headers=headers("acme", **extra_headers), timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"], error["message"]
