"""OpenTelemetry traces across real processes: a real gateway and a real simulated worker
export over OTLP/gRPC to a real receiver in this process; one trace spans both, with the
spans nested as docs/observability.md ("Traces") says."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.otlp_receiver import OtlpReceiver, ReceivedSpan
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "5",
            "--num-kv-blocks", "256"]  # fmt: skip
# Batches leave every 100 ms instead of 5 s: the test waits less.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
REQUEST_SPAN = "POST /v1/chat/completions"
WORKER_SPANS = {"kvflow.queue", "kvflow.prefill", "kvflow.decode"}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


def _start(receiver: OtlpReceiver, gateway_ratio: str) -> tuple[WorkerProcess, GatewayProcess]:
    # The worker is configured by OTel's standard variables, the gateway by its flags.
    worker = launch_worker(SIM_ARGS, timeout_s=120, env={
        **FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER_ARG": "1.0"})  # fmt: skip
    gateway = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                              "--otlp-traces-endpoint", receiver.endpoint,
                              "--otlp-traces-sample-ratio", gateway_ratio],
                             env=FAST_EXPORT)  # fmt: skip
    gateway.wait_ready()
    return worker, gateway


def _chat(gateway: GatewayProcess, request_id: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a secret prompt"}], max_tokens=7,
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id},
    )  # fmt: skip


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_one_trace_spans_gateway_and_worker(receiver: OtlpReceiver) -> None:
    worker, gateway = _start(receiver, "1.0")
    try:
        completion = _chat(gateway, "trace-me-1")
        assert completion.usage is not None and completion.usage.completion_tokens == 7
        spans = receiver.wait_for({REQUEST_SPAN, "kvflow.worker.generate", *WORKER_SPANS})
    finally:
        gateway.stop()
        worker.stop()
    request = _one(spans, REQUEST_SPAN)
    route = _one(spans, "kvflow.route")
    attempt = _one(spans, "kvflow.worker_attempt")
    generate = _one(spans, "kvflow.worker.generate")
    phases = {name: _one(spans, name) for name in WORKER_SPANS}

    # One trace across both processes, nested: request > route, attempt > worker > phases.
    assert {s.trace_id for s in spans} == {request.trace_id}
    assert request.service == route.service == attempt.service == "kvflow-router"
    assert generate.service == "kvflow-worker"
    assert request.parent_span_id == ""
    assert route.parent_span_id == request.span_id
    assert attempt.parent_span_id == request.span_id
    assert generate.parent_span_id == attempt.span_id
    for phase in phases.values():
        assert phase.parent_span_id == generate.span_id
        assert generate.start_ns <= phase.start_ns <= phase.end_ns <= generate.end_ns
    queue, prefill, decode = (phases[n] for n in ("kvflow.queue", "kvflow.prefill",
                                                  "kvflow.decode"))  # fmt: skip
    assert queue.end_ns == prefill.start_ns and prefill.end_ns == decode.start_ns

    assert request.attributes["kvflow.request_id"] == "trace-me-1"
    assert request.attributes["gen_ai.request.model"] == MODEL
    assert request.attributes["kvflow.tenant"] == "anonymous"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gen_ai.usage.output_tokens"] == 7
    assert request.attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert route.attributes["kvflow.route.worker"] == worker.address
    # The worker sees the gateway's own id, never the caller's; the trace ties them.
    worker_request_id = attempt.attributes["kvflow.worker_request_id"]
    assert worker_request_id.startswith("req_") and worker_request_id.endswith("-c0-a0")
    assert generate.attributes["kvflow.worker_request_id"] == worker_request_id
    assert generate.attributes["gen_ai.request.model"] == MODEL
    assert generate.attributes["kvflow.tenant"] == "anonymous"
    assert generate.attributes["gen_ai.usage.output_tokens"] == 7
    assert generate.attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert generate.attributes["gen_ai.response.finish_reasons"] == ["FINISH_REASON_LENGTH"]
    # No text anywhere: only ids, names and counts.
    values = [str(v) for s in spans for v in s.attributes.values()]
    assert not any("secret" in v for v in values), values


def test_sampling_zero_exports_nothing(receiver: OtlpReceiver) -> None:
    worker, gateway = _start(receiver, "0")
    try:
        for i in range(3):
            _chat(gateway, f"unsampled-{i}")
        time.sleep(1.5)  # fifteen export periods
    finally:
        gateway.stop()
        worker.stop()  # a stop flushes what is batched
    assert receiver.snapshot() == []


_NO_ENDPOINT = """
import sys
from kvflow.router import cli, tracing
from kvflow.engine_worker import settings as worker_settings, tracing as worker_tracing
gateway = cli.parse_args(["--workers", "127.0.0.1:1"], env={})
worker = worker_settings.parse_args(["--simulate"])
assert not tracing.configure(gateway.tracing) and not tracing.is_enabled()
assert not worker_tracing.configure(worker.tracing)
assert tracing.grpc_metadata() == ()
with tracing.span("x") as span:
    assert span is None
assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")], "SDK imported"
assert not [m for m in sys.modules if m.startswith("opentelemetry.exporter")]
print("ok")
"""


def test_no_endpoint_creates_no_exporter() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", _NO_ENDPOINT], capture_output=True,
                          text=True, env=env, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_disaggregated_request_traces_both_workers(receiver: OtlpReceiver) -> None:
    """A long prompt goes to a prefill worker, whose blocks move to the decode worker: both
    workers' spans sit under the one attempt, each with its kv_transfer phase."""
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    pd_args = [*SIM_ARGS, "--kv-transport", "tcp", "--role"]
    prefill = launch_worker([*pd_args, "prefill"], timeout_s=120, env=env)
    decode = launch_worker([*pd_args, "decode"], timeout_s=120, env=env)
    gateway = launch_gateway(["--served-model-name", MODEL, "--otlp-traces-endpoint",
                              receiver.endpoint, "--workers",
                              f"{prefill.address},{decode.address}"], env=FAST_EXPORT)  # fmt: skip
    try:
        gateway.wait_ready(num_workers=2)
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        completion = client.completions.create(
            model=MODEL, prompt=list(range(5, 600)), max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert completion.usage is not None
        # The router's attempt span is exported by another process than the workers' spans,
        # and may come after them (a clean-clone CI run once stopped waiting without it).
        spans = receiver.wait_for(
            {"kvflow.worker.prefill", "kvflow.worker.generate", "kvflow.worker_attempt"}
        )
    finally:
        gateway.stop()
        for w in (prefill, decode):
            w.stop()
    attempt = _one(spans, "kvflow.worker_attempt")
    assert attempt.attributes["kvflow.route.decision"] == "disaggregated"
    on_prefill = _one(spans, "kvflow.worker.prefill")
    on_decode = _one(spans, "kvflow.worker.generate")
    assert on_prefill.parent_span_id == on_decode.parent_span_id == attempt.span_id
    assert {s.trace_id for s in spans} == {attempt.trace_id}
    children = {(s.parent_span_id, s.name): s for s in spans}
    phases = [
        (on_prefill, ("kvflow.queue", "kvflow.prefill", "kvflow.kv_transfer")),
        (on_decode, ("kvflow.queue", "kvflow.kv_transfer", "kvflow.decode")),
    ]
    for parent, names in phases:
        assert all((parent.span_id, n) in children for n in names), (parent.name, children.keys())
    remote = on_decode.attributes["kvflow.usage.remote_tokens"]
    transfer = children[(on_decode.span_id, "kvflow.kv_transfer")]
    assert remote > 0 and transfer.attributes["kvflow.usage.remote_tokens"] == remote
    assert on_prefill.attributes["kvflow.kv_transfer.bytes"] > 0
    assert on_decode.attributes["gen_ai.usage.output_tokens"] == 5


def test_a_streamed_request_span_lasts_to_the_end_of_its_stream(receiver: OtlpReceiver) -> None:
    worker, gateway = _start(receiver, "1.0")
    try:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ))  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        spans = receiver.wait_for({REQUEST_SPAN, "kvflow.worker.generate"})
    finally:
        gateway.stop()
        worker.stop()
    request = _one(spans, REQUEST_SPAN)
    generate = _one(spans, "kvflow.worker.generate")
    assert generate.trace_id == request.trace_id
    assert request.attributes["gen_ai.usage.output_tokens"] == 7
    assert request.end_ns >= generate.end_ns
