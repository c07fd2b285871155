"""A real router process drains on SIGTERM: /ready turns 503 at once, new requests get a
503 with Retry-After, a running stream finishes whole, and the process exits 0; past the
grace, a stream still running is cut and aborted on its worker."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
import httpx
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
# 50 ms a token: a 60-token stream runs 3 s, far longer than uvicorn's own grace of 5 s
# would matter for, and long enough to act while it runs.
STEP_MS = 50
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--num-kv-blocks", "256",
            "--sim-base-step-ms", str(STEP_MS)]  # fmt: skip


@contextmanager
def router(grace_s: float) -> Iterator[tuple[GatewayProcess, WorkerProcess]]:
    with ExitStack() as stack:
        worker = launch_worker(SIM_ARGS, timeout_s=120)
        stack.callback(worker.stop, timeout_s=10)
        gateway = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                                  "--drain-grace-s", str(grace_s)])  # fmt: skip
        stack.callback(gateway.stop, sig=signal.SIGKILL)  # only if a test failed first
        gateway.wait_ready()
        yield gateway, worker


def _request(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": list(range(40)), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def _events(lines: Iterator[str]) -> Iterator[dict[str, object] | str]:
    for line in lines:
        if line == "data: [DONE]":
            yield "[DONE]"
        elif line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def _wait_until_draining(gateway: GatewayProcess) -> httpx.Response:
    deadline_s = time.monotonic() + 5
    while (ready := httpx.get(f"{gateway.url}/ready", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline_s, "/ready stayed 200 after SIGTERM"
        time.sleep(0.02)
    return ready


def test_sigterm_lets_a_running_stream_finish_while_ready_and_new_requests_say_503() -> None:
    num_tokens = 60
    with router(grace_s=30) as (gateway, _):
        assert httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200
        url = f"{gateway.base_url}/completions"
        with httpx.stream("POST", url, json=_request(num_tokens), timeout=60) as r:
            assert r.status_code == 200
            events = _events(r.iter_lines())
            assert isinstance(next(events), dict)  # the stream runs
            gateway.proc.send_signal(signal.SIGTERM)
            ready = _wait_until_draining(gateway)
            assert ready.status_code == 503 and ready.json()["draining"] is True
            refused = httpx.post(url, json=_request(4), timeout=5)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert gateway.proc.poll() is None  # still serving the stream
            rest = list(events)
        assert rest[-1] == "[DONE]", rest[-3:]
        usage = next(e["usage"] for e in rest if isinstance(e, dict) and e.get("usage"))
        assert usage["completion_tokens"] == num_tokens  # type: ignore[index]
        stream_done_s = time.monotonic()
        assert gateway.proc.wait(timeout=10) == 0
        assert time.monotonic() - stream_done_s < 5.0  # once drained, not at the grace (30 s)
        assert "drained: every request finished" in gateway.log


def test_past_the_grace_a_stream_is_cut_and_aborted_on_its_worker() -> None:
    grace_s = 1.0
    # 400 tokens of 50 ms: 20 s, far past the grace.
    with router(grace_s=grace_s) as (gateway, worker):
        url = f"{gateway.base_url}/completions"
        events_seen = 0
        with httpx.stream("POST", url, json=_request(400), timeout=60) as r:
            events = _events(r.iter_lines())
            assert isinstance(next(events), dict)
            signalled_s = time.monotonic()
            gateway.proc.send_signal(signal.SIGTERM)
            try:
                for event in events:
                    assert event != "[DONE]", "the stream ran to its end"
                    events_seen += 1
            except httpx.RemoteProtocolError:
                pass  # cut mid-body: what a client of a stopped server sees
        assert gateway.proc.wait(timeout=10) == 0
        # The grace, the final close (2 s), the pool's shutdown, on a busy machine.
        assert time.monotonic() - signalled_s < grace_s + 2 + 4
        assert events_seen < 400
        assert "cutting 1 running requests" in gateway.log
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            deadline_s = time.monotonic() + 5
            while (load := stub.Load(pb.LoadRequest(), timeout=5)).num_running > 0:
                assert time.monotonic() < deadline_s, f"the worker still runs it: {load}"
                time.sleep(0.1)
