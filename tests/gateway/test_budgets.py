"""Budgets in money end to end: two gateway processes on one redis-server charge a tenant's
spend at the configured prices; past the warning fraction the answer carries the warning
header, at the budget the next request is refused with 429 and Retry-After naming it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import running_redis
from testkit.worker_process import launch_worker

from kvflow.router.tenants.buckets import seconds_until_next_utc_day
from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
KEY = "sk-budget-0123456789"
# 1 pico-USD per prompt token (the smallest price there is: six decimals per million) and
# 1 USD per completion token, so each 2-token answer costs 2 USD and a little.
PRICES = {"input_usd_per_million_tokens": "0.000001", "output_usd_per_million_tokens": 1_000_000}


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    config = {
        "tenants": [
            {
                "name": "budget",
                "api_key_sha256": hash_api_key(KEY),
                "daily_budget_usd": 5,
                "monthly_budget_usd": "100.00",
                "budget_warning_fraction": 0.75,
            }
        ],
        "prices": {MODEL: PRICES},
    }
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_redis() as redis:
        worker = launch_worker(["--simulate", "--served-model-name", MODEL,
                                "--sim-base-step-ms", "2"], timeout_s=120)  # fmt: skip
        started = []
        try:
            args = ["--served-model-name", MODEL, "--workers", worker.address,
                    "--config", str(path), "--redis-url", redis.url]  # fmt: skip
            for _ in range(2):
                g = launch_gateway(args)
                started.append(g)
                g.wait_ready()
            yield started
        finally:
            for g in started:
                g.stop()
            worker.stop(timeout_s=10)


def _chat(g: GatewayProcess, request_id: str, *, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
    return httpx.post(f"{g.base_url}/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}",
                               "x-request-id": request_id})  # fmt: skip


def _usage(answer: httpx.Response) -> dict[str, int]:
    if answer.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in answer.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        usage: dict[str, int] = events[-1]["usage"]
        return usage
    usage = answer.json()["usage"]
    return usage


def _log_line(g: GatewayProcess, request_id: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in g.log.splitlines():
            if f"request_id={request_id} " in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}:\n{g.log}")


def _metric_sum(gateways: list[GatewayProcess], pattern: str) -> float:
    total = 0.0
    for g in gateways:
        for value in re.findall(pattern, httpx.get(f"{g.url}/metrics").text):
            total += float(value)
    return total


def test_tenant_sees_the_warning_then_429_across_replicas(gateways: list[GatewayProcess]) -> None:
    spent_pusd = 0
    warnings = []
    # Alternate replicas: the spend one charged is what the other judges. The third answer
    # streams: its header is sent before the first token.
    for i in range(3):
        request_id = f"budget-{i}-{time.time_ns()}"
        answer = _chat(gateways[i % 2], request_id, stream=i == 2)
        assert answer.status_code == 200, answer.text
        usage = _usage(answer)
        assert usage["completion_tokens"] == 2
        spend = usage["prompt_tokens"] * 1 + usage["completion_tokens"] * 10**12
        spent_pusd += spend
        warnings.append(answer.headers.get("x-kvflow-budget-warning"))
        # The request log line has the spend, every digit of it.
        line = _log_line(gateways[i % 2], request_id)
        assert f" spend_usd={Decimal(spend).scaleb(-12).normalize():f} " in line, line
    # 0 and 2.0... USD spent before the first two: under 75% of 5 USD; 4.0... before the third.
    assert warnings == [None, None, "daily 80% of 5.00 USD"]
    refused = _chat(gateways[1], "budget-refused")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert "daily_budget_usd" in error["message"] and "5.00 USD" in error["message"]
    assert error["type"] == "insufficient_quota"
    retry_after = float(refused.headers["retry-after"])
    assert abs(retry_after - seconds_until_next_utc_day(time.time())) <= 5
    # The spend is exactly tokens x prices, in the shared totals ...
    usage_now = httpx.get(f"{gateways[0].base_url}/usage",
                          headers={"authorization": f"Bearer {KEY}"}).json()  # fmt: skip
    assert usage_now["scope"] == "cluster"
    assert usage_now["spend_pusd"] == spent_pusd
    # ... and on /metrics, summed over the replicas (floats there: to the nano-dollar).
    spend = _metric_sum(
        gateways, r'kvflow_router_tenant_spend_usd_total\{model="sim",tenant="budget"\} (\S+)'
    )
    assert spend == pytest.approx(spent_pusd / 10**12, abs=1e-9)
    warned = _metric_sum(
        gateways,
        r'kvflow_router_tenant_budget_warnings_total\{budget="daily",tenant="budget"\} (\S+)',
    )
    assert warned == 1
    refusals = _metric_sum(
        gateways,
        r'kvflow_router_tenant_rejections_total\{limit="daily_budget_usd",tenant="budget"\} (\S+)',
    )
    assert refusals == 1
