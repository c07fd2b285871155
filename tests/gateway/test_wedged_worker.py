"""A worker whose engine thread is stuck keeps its gRPC connection up: the gateway must
stop sending it requests anyway, once its Health says it is not serving (liveness.py)."""

from __future__ import annotations

import re
import time

import grpc
import httpx
import pytest
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration]

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "2",
            "--num-kv-blocks", "256", "--engine-stall-timeout-s", "1"]  # fmt: skip


def test_new_requests_avoid_a_worker_whose_engine_is_stuck() -> None:
    healthy = launch_worker(SIM_ARGS, timeout_s=120)
    wedged = launch_worker(SIM_ARGS, timeout_s=120, env={"KVFLOW_FAULT_HANG_ON_STEP": "1"})
    gateway = None
    try:
        gateway = launch_gateway(["--served-model-name", MODEL,
                                  "--workers", f"{healthy.address},{wedged.address}"])  # fmt: skip
        gateway.wait_ready(num_workers=2)
        # Wedge it directly (past the gateway): its first step never ends.
        channel = grpc.insecure_channel(wedged.address)
        stuck = pb_grpc.WorkerStub(channel).Generate(
            pb.GenerateRequest(request_id="stuck", prompt_token_ids=list(range(20)),
                               sampling=pb.SamplingParams(max_tokens=4)),
            timeout=60,
        )  # fmt: skip
        time.sleep(1.0 + 1.5)  # the stall limit, then a health poll or two
        chosen = []
        for i in range(12):
            body = {"model": MODEL, "prompt": list(range(100 + i, 140 + i)), "max_tokens": 3,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{gateway.base_url}/completions", json=body,
                           headers={"x-kvflow-route": "1"}, timeout=20)  # fmt: skip
            assert r.status_code == 200, r.text
            chosen.append(re.search(r"worker=([^;]+)", r.headers["x-kvflow-route"]).group(1))  # type: ignore[union-attr]
        assert set(chosen) == {healthy.address}
        stuck.cancel()
        channel.close()
    finally:
        if gateway is not None:
            gateway.stop()
        wedged.stop(timeout_s=10)
        healthy.stop(timeout_s=10)
