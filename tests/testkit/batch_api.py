"""The Batch API tests' client side (tests/gateway/test_batch*.py): a gateway over a
simulated worker, the official openai SDK, and batch lines, files and waits."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

MODEL = "sim"
KEY_A = "sk-batch-tenant-a-0123"
KEY_B = "sk-batch-tenant-b-0123"
KEY_C = "sk-batch-tenant-c-0123"  # a daily budget of 1 token: spent by its first request


def simulated_worker() -> Iterator[WorkerProcess]:
    """The tests' worker (a module fixture's body): simulated, 20 ms a step."""
    w = launch_worker(["--simulate", "--served-model-name", MODEL,
                       "--sim-base-step-ms", "20"], timeout_s=120)  # fmt: skip
    try:
        yield w
    finally:
        w.stop(timeout_s=10)


def batch_gateway(worker: WorkerProcess, config: Path, *store: str, extra: tuple[str, ...] = ()
             ) -> GatewayProcess:  # fmt: skip
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--config", str(config), *store, *extra])  # fmt: skip
    g.wait_ready()
    return g


def batch_client(g: GatewayProcess, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=key, max_retries=0, timeout=30)


def batch_line(custom_id: str, *, max_tokens: int = 2, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": custom_id}],
                     "max_tokens": max_tokens, "ignore_eos": True, **body}}  # fmt: skip


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def create(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    file_id = upload(client, lines)
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60
          ) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(s) for s in client.files.content(file_id).text.splitlines()]
