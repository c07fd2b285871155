"""An embedding worker that dies: the router's next request to it fails over to another
worker of the pool, and the caller sees only its vectors."""

from __future__ import annotations

import signal

import openai
import pytest
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "wordllama-l2-supercat"


def test_a_dead_embedding_worker_is_failed_over() -> None:
    workers = [launch_worker(["--task", "embed"]) for _ in range(2)]
    try:
        # The router tries the least loaded first, ties by address: the first in order.
        first, other = sorted(workers, key=lambda w: w.address)
        gateway = launch_gateway(["--workers", f"{first.address},{other.address}"])
        try:
            gateway.wait_ready(num_workers=2)
            client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
            before = client.embeddings.create(model=MODEL, input="still here")
            first.stop(signal.SIGKILL)
            # Sent before the router's next probe of the dead worker (every 250 ms).
            after = client.embeddings.create(model=MODEL, input="still here")
            assert after.data[0].embedding == before.data[0].embedding
            assert f"worker {first.address} is unhealthy" in gateway.log
        finally:
            gateway.stop()
    finally:
        for w in workers:
            w.stop(timeout_s=10)
