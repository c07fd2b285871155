"""Engine-thread liveness behind /health and gRPC Health: a worker whose engine thread is
stuck in a step, or has stopped, says so, so the kubelet restarts it and routers stop
sending it requests; an idle worker stays healthy however long it idles."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.engine_worker.liveness import EngineHeartbeat
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_idle_is_healthy_a_long_step_is_not() -> None:
    clock = Clock()
    beat = EngineHeartbeat(stall_timeout_s=60, clock=clock)
    assert beat.problem() is None
    clock.now_s += 3600  # an hour idle: still healthy
    assert beat.problem() is None
    beat.working()
    clock.now_s += 59
    assert beat.problem() is None
    clock.now_s += 2
    problem = beat.problem()
    assert problem is not None and "61 s" in problem and "--engine-stall-timeout-s" in problem
    beat.waiting()  # the step ended after all
    assert beat.problem() is None


def test_a_stopped_thread_is_unhealthy() -> None:
    beat = EngineHeartbeat(stall_timeout_s=60)
    thread = threading.Thread(target=lambda: None)
    beat.watch(thread)
    thread.start()
    thread.join()
    assert beat.problem() == "the engine thread has stopped"


def _http(worker: WorkerProcess, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{worker.metrics_port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.integration
def test_a_wedged_engine_fails_health_and_grpc_health() -> None:
    worker = launch_worker(
        ["--simulate", "--sim-base-step-ms", "1", "--num-kv-blocks", "64",
         "--engine-stall-timeout-s", "1"],
        timeout_s=60,
        env={"KVFLOW_FAULT_HANG_ON_STEP": "1"},
    )  # fmt: skip
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            assert _http(worker, "/health") == (200, "ok\n")
            assert stub.Health(pb.HealthRequest()).is_serving
            # The first step hangs for good; the stream gets nothing.
            call = stub.Generate(
                pb.GenerateRequest(request_id="stuck", prompt_token_ids=list(range(20)),
                                   sampling=pb.SamplingParams(max_tokens=4)),
                timeout=30,
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while _http(worker, "/health")[0] == 200:
                assert time.monotonic() < deadline, "/health never noticed the stuck step"
                time.sleep(0.1)
            status, body = _http(worker, "/health")
            assert status == 503 and "in one step for" in body
            assert _http(worker, "/ready")[0] == 503
            assert not stub.Health(pb.HealthRequest()).is_serving
            # /metrics still answers: the operator can see what happened.
            assert _http(worker, "/metrics")[0] == 200
            call.cancel()
    finally:
        worker.stop(timeout_s=10)
