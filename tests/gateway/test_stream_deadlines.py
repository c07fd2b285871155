"""First-token and token-stall deadlines against real worker processes whose engine hangs
(KVFLOW_FAULT_HANG_ON_STEP) or whose stream pauses (KVFLOW_FAULT_STREAM_PAUSE_*), with
liveness out of the way (--engine-stall-timeout-s 600): only the router's deadlines can
save these requests.

- wedged before the first token: the request is answered by another worker, and the next
  requests avoid the wedged one (its circuit opened), though its Health still says serving;
- wedged after some tokens: the stream ends with an error event, not a hang, and a
  non-streaming request gets a 503 JSON at once;
- stalled mid-stream: the request is aborted on the worker, which frees its blocks.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--num-kv-blocks", "256",
            "--engine-stall-timeout-s", "600"]  # fmt: skip
FIRST_TOKEN_S = 2.0
STALL_S = 2.0
# What a busy 2-core machine adds to a deadline before the client sees its effect.
SLACK_S = 4.0


@contextmanager
def cluster(*envs: dict[str, str], step_ms: float = 2) -> Iterator[
    tuple[GatewayProcess, list[WorkerProcess]]
]:  # fmt: skip
    """One simulated worker per ``envs`` (its fault hooks) behind a gateway with short
    deadlines; wedged workers are killed at the end (their drain would wait for the hung
    engine thread)."""
    with ExitStack() as stack:
        workers = []
        for env in envs:
            worker = launch_worker([*SIM_ARGS, "--sim-base-step-ms", str(step_ms)],
                                   timeout_s=120, env=env)  # fmt: skip
            stack.callback(worker.stop, sig=signal.SIGKILL if env else signal.SIGTERM)
            workers.append(worker)
        gateway = launch_gateway(["--served-model-name", MODEL,
                                  "--workers", ",".join(w.address for w in workers),
                                  "--first-token-timeout-s", str(FIRST_TOKEN_S),
                                  "--token-stall-timeout-s", str(STALL_S)])  # fmt: skip
        stack.callback(gateway.stop)
        gateway.wait_ready(num_workers=len(workers))
        yield gateway, workers


@dataclass
class StreamResult:
    status: int
    route: str
    texts: list[str] = field(default_factory=list)
    last_text_s: float = 0.0
    error: dict[str, object] | None = None
    error_s: float = 0.0
    is_done: bool = False
    completion_tokens: int = 0


def stream(gateway: GatewayProcess, prompt: list[int], max_tokens: int) -> StreamResult:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{gateway.base_url}/completions", json=body,
                      headers={"x-kvflow-route": "1"}, timeout=60) as r:  # fmt: skip
        result = StreamResult(r.status_code, r.headers.get("x-kvflow-route", ""))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.is_done = True
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result.error, result.error_s = event["error"], time.monotonic()
            elif event.get("usage"):
                result.completion_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                result.texts.append(event["choices"][0]["text"])
                result.last_text_s = time.monotonic()
    return result


def workers_tried(route: str) -> list[str]:
    return re.findall(r"worker=([^;,]+)", route)


def deadline_misses(gateway: GatewayProcess, kind: str) -> float:
    return sample(f"{gateway.url}/metrics", "kvflow_router_deadline_misses_total", kind=kind)


def test_a_worker_wedged_before_its_first_token_is_failed_over_and_then_avoided() -> None:
    with cluster({}, {"KVFLOW_FAULT_HANG_ON_STEP": "1"}) as (gateway, (healthy, wedged)):
        # Until placement picks the wedged worker once (a tie between idle workers).
        for i in range(8):
            started_s = time.monotonic()
            result = stream(gateway, list(range(100 * i, 100 * i + 40)), max_tokens=8)
            elapsed_s = time.monotonic() - started_s
            assert result.status == 200 and result.is_done, result
            assert result.completion_tokens == 8 and result.error is None
            if wedged.address in workers_tried(result.route):
                break
        else:
            pytest.fail("placement never chose the wedged worker")
        # Answered by the healthy worker, after waiting the first-token deadline once.
        assert workers_tried(result.route) == [wedged.address, healthy.address]
        assert FIRST_TOKEN_S <= elapsed_s < FIRST_TOKEN_S + SLACK_S
        assert deadline_misses(gateway, "first_token") == 1
        assert deadline_misses(gateway, "token_stall") == 0
        # The wedged worker still says it serves (liveness is off), yet new requests avoid
        # it at once: each is fast and placed on the healthy worker only.
        with grpc.insecure_channel(wedged.address) as channel:
            assert pb_grpc.WorkerStub(channel).Health(pb.HealthRequest()).is_serving
        for i in range(6):
            started_s = time.monotonic()
            body = {"model": MODEL, "prompt": list(range(5000 + i, 5040 + i)), "max_tokens": 4}
            r = httpx.post(f"{gateway.base_url}/completions", json=body,
                           headers={"x-kvflow-route": "1"}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            assert workers_tried(r.headers["x-kvflow-route"]) == [healthy.address]
            assert time.monotonic() - started_s < FIRST_TOKEN_S


def test_a_worker_wedged_mid_stream_ends_the_stream_with_an_error_not_a_hang() -> None:
    # Its 6th engine step never ends: 5 tokens, then nothing, its connection up.
    with cluster({"KVFLOW_FAULT_HANG_ON_STEP": "6"}) as (gateway, _):
        result = stream(gateway, list(range(40)), max_tokens=50)
        assert result.status == 200 and 1 <= len(result.texts) <= 5, result
        assert result.error is not None and not result.is_done, result
        assert result.error["code"] == "worker_timeout" and result.error["type"] == "server_error"
        assert "no token for" in str(result.error["message"])
        # (Measured here: each arrival is late by a few ms of transit, not always equally.)
        assert STALL_S - 0.25 <= result.error_s - result.last_text_s < STALL_S + SLACK_S
        assert deadline_misses(gateway, "token_stall") == 1
        assert deadline_misses(gateway, "first_token") == 0
        # The only worker's circuit is open (for 10 s by default): a non-streaming request
        # is a 503 JSON at once, saying when the circuit half-opens.
        started_s = time.monotonic()
        body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 4}
        r = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=60)
        assert time.monotonic() - started_s < 2.0
        assert r.status_code == 503 and 1 <= int(r.headers["retry-after"]) <= 10, r.text
        assert r.json()["error"]["code"] == "circuit_open"


def _load(worker: WorkerProcess) -> pb.LoadResponse:
    with grpc.insecure_channel(worker.address) as channel:
        response: pb.LoadResponse = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=5)
        return response


def test_a_stalled_request_is_aborted_on_its_worker_which_frees_its_blocks() -> None:
    # The worker's stream pauses after 3 tokens for a minute; its engine runs on, and
    # would take 40 s more (2000 tokens of 20 ms) unless the request is aborted there.
    pause = {"KVFLOW_FAULT_STREAM_PAUSE_AFTER": "3", "KVFLOW_FAULT_STREAM_PAUSE_S": "60"}
    with cluster(pause, step_ms=20) as (gateway, (worker,)):
        started_s = time.monotonic()
        body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 2000,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{gateway.base_url}/completions", json=body, timeout=60)
        # Non-streaming: nothing was sent, so the stall is a retry, and with no other
        # worker a 503 naming the stall.
        assert r.status_code == 503, r.text
        assert "no token for" in r.json()["error"]["message"]
        assert time.monotonic() - started_s < STALL_S + SLACK_S
        deadline_s = time.monotonic() + 5
        while (load := _load(worker)).num_running + load.num_waiting > 0:
            assert time.monotonic() < deadline_s, f"the worker still runs the request: {load}"
            time.sleep(0.1)
        assert load.kv_usage == 0.0
