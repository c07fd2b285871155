"""Worker gRPC authentication with a per-pool token (engine_worker/auth.py), between real
processes: a worker with KVFLOW_WORKER_TOKEN refuses calls without it (unary and
streaming), a gateway given the same token serves through it, and a gateway without it
never counts the worker healthy, so it answers 503 instead of reaching it."""

from __future__ import annotations

import grpc
import httpx
import pytest
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

from kvflow.engine_worker.auth import is_authorized
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

MODEL = "sim"
TOKEN = "s3cret-token-of-the-pool"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "2",
            "--num-kv-blocks", "256"]  # fmt: skip


def test_is_authorized_wants_the_exact_bearer_token() -> None:
    assert is_authorized((("authorization", f"Bearer {TOKEN}"),), TOKEN)
    assert is_authorized((("x", "y"), ("authorization", f"Bearer {TOKEN}".encode())), TOKEN)
    assert not is_authorized((("authorization", f"Bearer {TOKEN}x"),), TOKEN)
    assert not is_authorized((("authorization", TOKEN),), TOKEN)
    assert not is_authorized(None, TOKEN)


@pytest.mark.integration
def test_a_worker_with_a_token_serves_only_callers_that_present_it() -> None:
    worker = launch_worker(SIM_ARGS, timeout_s=120, env={"KVFLOW_WORKER_TOKEN": TOKEN})
    gateways = []
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as unary:
                    stub.Health(pb.HealthRequest(), metadata=metadata, timeout=5)
                assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
                request = pb.GenerateRequest(request_id="x", prompt_token_ids=list(range(20)),
                                             sampling=pb.SamplingParams(max_tokens=2))  # fmt: skip
                with pytest.raises(grpc.RpcError) as stream:
                    list(stub.Generate(request, metadata=metadata, timeout=5))
                assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "KVFLOW_WORKER_TOKEN" in (stream.value.details() or "")
            good = (("authorization", f"Bearer {TOKEN}"),)
            assert stub.Health(pb.HealthRequest(), metadata=good, timeout=5).is_serving

        body = {"model": MODEL, "prompt": list(range(30)), "max_tokens": 3, "ignore_eos": True}
        trusted = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address],
                                 env={"KVFLOW_WORKER_TOKEN": TOKEN})  # fmt: skip
        gateways.append(trusted)
        trusted.wait_ready(num_workers=1)
        r = httpx.post(f"{trusted.base_url}/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3

        stranger = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address],
                                  env={"KVFLOW_WORKER_TOKEN": ""})  # fmt: skip
        gateways.append(stranger)
        r = httpx.post(f"{stranger.base_url}/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert httpx.get(f"{stranger.url}/ready", timeout=5).json()["workers_healthy"] == 0
    finally:
        for g in gateways:
            g.stop()
        worker.stop(timeout_s=10)
