"""The batch runner spends spare capacity only: while the pool's worker reports requests
waiting it starts no batch line, and it never has more lines in flight than
--batch-max-in-flight; with --batch-online-tpot-target-s, while the worker's decode step
with one more sequence would pass the headroom share of that target, it starts none
either. A real router process in front of a fake worker whose reported load the test
sets."""

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


def _wait_completed(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    deadline = time.monotonic() + 30
    while (done := client.batches.retrieve(batch_id)).status != "completed":
        assert time.monotonic() < deadline, done
        time.sleep(0.1)
    return done


def test_batch_waits_while_a_decode_step_with_it_would_pass_the_online_tpot_headroom(
    tmp_path: Path,
) -> None:
    # The router prices steps with its default step model (routing/cost.py: 6.6 ms a step,
    # 30.3 us a decoding sequence): 200 sequences decoding make a step with one more of
    # 12.7 ms, over half of a 20 ms target; none make it 6.6 ms, within.
    worker = CountingWorker(model=MODEL, num_running=200)
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--served-model-name", MODEL, "--workers", address,
                            "--batch-dir", str(tmp_path),
                            "--batch-online-tpot-target-s", "0.02",
                            "--batch-tpot-headroom-fraction", "0.5",
                            "--admission-poll-interval-s", "0.1"])  # fmt: skip
        try:
            g.wait_ready()
            client = openai.OpenAI(base_url=g.base_url, api_key="none", max_retries=0)
            file_id = client.files.create(file=("in.jsonl", io.BytesIO(_batch_file(4))),
                                          purpose="batch").id  # fmt: skip
            batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                          completion_window="24h")  # fmt: skip
            time.sleep(2.0)  # no queue anywhere, but the step has no room for a line
            held = client.batches.retrieve(batch.id)
            assert (held.status, len(worker.requests)) == ("in_progress", 0)
            worker.num_running = 0  # the online decodes ended: the step has room again
            done = _wait_completed(client, batch.id)
            assert done.request_counts is not None and done.request_counts.completed == 4
            assert len(worker.requests) == 4
        finally:
            g.stop()
