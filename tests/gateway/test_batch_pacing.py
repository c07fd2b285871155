"""The batch runner spends spare capacity only: while the pool's worker reports requests
waiting it starts no batch line, and it never has more lines in flight than
--batch-max-in-flight. A real router process in front of a fake worker whose reported
queue the test sets."""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import launch_gateway

from kvflow.proto import worker_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "fake"


class CountingWorker(FakeWorker):
    """Also keeps the most Generate calls it had at once."""

    num_now: int = 0
    most_at_once: int = 0

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.num_now += 1
        self.most_at_once = max(self.most_at_once, self.num_now)
        try:
            async for response in super().Generate(request, context):
                yield response
        finally:
            self.num_now -= 1


def _batch_file(n: int) -> bytes:
    lines = [{"custom_id": f"p-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 3}}
             for i in range(n)]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_batch_waits_while_online_requests_queue_and_keeps_its_in_flight_bound(
    tmp_path: Path,
) -> None:
    worker = CountingWorker(model=MODEL, num_waiting=3, token_delay_s=0.05)
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--served-model-name", MODEL, "--workers", address,
                            "--batch-dir", str(tmp_path), "--batch-max-in-flight", "2",
                            "--admission-poll-interval-s", "0.1"])  # fmt: skip
        try:
            g.wait_ready()
            client = openai.OpenAI(base_url=g.base_url, api_key="none", max_retries=0)
            file_id = client.files.create(file=("in.jsonl", io.BytesIO(_batch_file(12))),
                                          purpose="batch").id  # fmt: skip
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                          completion_window="24h")  # fmt: skip
            time.sleep(2.0)  # the runner has looked many times, and held every time
            held = client.batches.retrieve(batch.id)
            assert (held.status, len(worker.requests)) == ("in_progress", 0)
            worker.num_waiting = 0  # online traffic gone: spare capacity
            deadline = time.monotonic() + 30
            while (done := client.batches.retrieve(batch.id)).status != "completed":
                assert time.monotonic() < deadline, done
                time.sleep(0.1)
            assert done.request_counts is not None and done.request_counts.completed == 12
            assert len(worker.requests) == 12
            assert worker.most_at_once == 2
        finally:
            g.stop()
