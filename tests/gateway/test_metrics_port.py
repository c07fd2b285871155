"""`--metrics-port`: the gateway's metrics on a port of their own, none on the API's (which
tenants reach). A real gateway process and a real simulated worker."""

from __future__ import annotations

import httpx
import openai
import pytest
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"


def test_metrics_move_to_their_own_port() -> None:
    worker = launch_worker(["--simulate", "--served-model-name", MODEL], timeout_s=120)
    gateway = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                              "--metrics-port", "0"])  # fmt: skip
    try:
        gateway.wait_ready(num_workers=1)
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        public = httpx.get(f"{gateway.url}/metrics")
        assert public.status_code == 404 and public.json()["error"]["code"] == "unknown_url"
        port = int(gateway.ready_fields()["metrics_port"])
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200
        assert 'kvflow_router_requests_total{code="200",endpoint="/v1/completions"}' in scraped.text
        assert 'kvflow_router_workers_healthy{pool="default"} 1.0' in scraped.text
    finally:
        gateway.stop()
        worker.stop(timeout_s=10)
