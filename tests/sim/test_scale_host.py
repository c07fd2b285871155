"""Several simulated workers in one process (kvflow.engine_worker.sim.host), as the scale
check runs them: each its own port, instance, engine and KV cache, behind a real gateway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import httpx
import pytest
from testkit.gateway_process import running_gateway

from kvflow.engine_worker.sim.host import parse_host_args
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

MODEL = "sim-host"


def test_host_flags_are_worker_flags_and_pd_is_refused() -> None:
    host = parse_host_args(["--num-workers", "3", "--sim-profile", "h100-llama3-8b"])
    assert host.num_workers == 3
    assert host.worker.simulate and host.worker.sim_profile == "h100-llama3-8b"
    with pytest.raises(SystemExit, match="colocated workers only"):
        parse_host_args(["--num-workers", "2", "--role", "prefill"])
    with pytest.raises(SystemExit, match=r"--num-workers must be 1\.\.256"):
        parse_host_args(["--num-workers", "0"])


@pytest.mark.integration
def test_three_workers_in_one_process_behind_the_gateway() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.engine_worker.sim.host", "--num-workers", "3",
         "--port", "0", "--served-model-name", MODEL, "--sim-base-step-ms", "1",
         "--num-kv-blocks", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("KVFLOW_SIM_HOST_READY grpc_ports="), line
        addresses = [f"127.0.0.1:{p}" for p in line.strip().split("=")[1].split(",")]
        assert len(set(addresses)) == 3

        def call(address: str, method: str, request: object) -> object:
            with grpc.insecure_channel(address) as channel:
                return getattr(pb_grpc.WorkerStub(channel), method)(request, timeout=10)

        infos = [call(a, "Health", pb.HealthRequest()).info for a in addresses]  # type: ignore[attr-defined]
        assert len({i.instance_id for i in infos}) == 3
        assert {i.model for i in infos} == {MODEL} and {i.num_total_blocks for i in infos} == {64}

        with running_gateway(["--workers", ",".join(addresses), "--seed", "0"]) as gateway:
            gateway.wait_ready(num_workers=3)
            body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "word " * 100}]}  # fmt: skip
            r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        # Exactly one worker ran it and caches its blocks: the caches are separate.
        cached = [call(a, "Load", pb.LoadRequest()).num_cached_blocks for a in addresses]  # type: ignore[attr-defined]
        assert sorted(cached)[:2] == [0, 0] and max(cached) >= 100 // 16, cached
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
