"""A real `kvflow worker` process on loopback, driven by a real gRPC client.

The simulated mode runs the real scheduler, block accounting and server; a step sleeps
1 ms + 0.05 ms per token so a long generation can be interrupted mid-stream.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import metric_names as names
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.block_hash import block_hashes
from kvflow.proto.priority_class import CLASS_WORDS

pytestmark = pytest.mark.integration

SIM_ARGS = [
    "--simulate",
    "--sim-base-step-ms",
    "1",
    "--sim-per-token-ms",
    "0.05",
    "--num-kv-blocks",
    "256",
]


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker([*SIM_ARGS, "--max-model-len", "1024"], timeout_s=60)
    yield w
    w.stop(timeout_s=10)


@pytest.fixture
def stub(worker: WorkerProcess) -> Iterator[pb_grpc.WorkerStub]:
    with grpc.insecure_channel(worker.address) as channel:
        yield pb_grpc.WorkerStub(channel)


def generate(
    stub: pb_grpc.WorkerStub, rid: str, prompt: list[int], **sampling: object
) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling)
    )
    return list(stub.Generate(req, timeout=30))


def wait_idle(stub: pb_grpc.WorkerStub, timeout_s: float = 10.0) -> pb.LoadResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        load = stub.Load(pb.LoadRequest())
        if load.num_running == 0 and load.num_waiting == 0 and load.kv_usage == 0.0:
            return load
        assert time.monotonic() < deadline, f"worker still busy: {load}"
        time.sleep(0.05)


def test_health_reports_what_a_router_needs(stub: pb_grpc.WorkerStub) -> None:
    health = stub.Health(pb.HealthRequest())
    assert health.is_serving
    info = health.info
    assert info.block_size == 16 and info.max_model_len == 1024 and info.num_total_blocks == 256
    assert (
        info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and len(info.hash_seed) == 16
    )
    assert info.role == pb.ROLE_COLOCATED and info.instance_id


def test_generate_streams_tokens_then_usage(stub: pb_grpc.WorkerStub) -> None:
    msgs = generate(stub, "stream-1", list(range(40)), max_tokens=6, ignore_eos=True)
    tokens = [t for m in msgs for t in m.token_ids]
    assert len(tokens) == 6 and len(msgs) >= 2
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 6)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s
    # The same prompt again is served from the prefix cache, and continues identically.
    again = generate(stub, "stream-2", list(range(40)), max_tokens=6, ignore_eos=True)
    assert [t for m in again for t in m.token_ids] == tokens
    assert again[-1].usage.cached_tokens == 32


def test_client_disconnect_aborts_and_frees_blocks(stub: pb_grpc.WorkerStub) -> None:
    call = stub.Generate(
        pb.GenerateRequest(
            request_id="walk-away",
            prompt_token_ids=list(range(100, 400)),
            sampling=pb.SamplingParams(max_tokens=600, ignore_eos=True),
        )
    )
    it = iter(call)
    next(it)
    next(it)
    assert stub.Load(pb.LoadRequest()).num_running == 1
    call.cancel()
    wait_idle(stub)


def test_abort_rpc_ends_the_stream_with_abort(stub: pb_grpc.WorkerStub) -> None:
    call = stub.Generate(
        pb.GenerateRequest(
            request_id="to-abort",
            prompt_token_ids=list(range(50)),
            sampling=pb.SamplingParams(max_tokens=700, ignore_eos=True),
        )
    )
    it = iter(call)
    next(it)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    rest = list(it)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    wait_idle(stub)
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).found


def _sampling_with_unknown_field() -> bytes:
    raw = pb.GenerateRequest(request_id="u", prompt_token_ids=[1, 2]).SerializeToString()
    return raw + bytes([0xA0, 0x06, 0x01])  # field 100 (tag 100 << 3 | varint), value 1


@pytest.mark.parametrize(
    ("request_msg", "message"),
    [
        (pb.GenerateRequest(request_id="e1", prompt_token_ids=[]), "prompt is empty"),
        (
            pb.GenerateRequest(request_id="e2", prompt_token_ids=list(range(1024))),
            "shorten the prompt",
        ),
        (
            pb.GenerateRequest(
                request_id="e3", prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=-3)
            ),
            "max_tokens must be >= 1",
        ),
        (pb.GenerateRequest(request_id="e4", prompt_token_ids=[49152]), "outside the vocabulary"),
        (pb.GenerateRequest.FromString(_sampling_with_unknown_field()), "unknown fields [100]"),
        (pb.GenerateRequest(request_id="", prompt_token_ids=[1]), "request_id must not be empty"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_worker_keeps_serving(
    stub: pb_grpc.WorkerStub, request_msg: pb.GenerateRequest, message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_msg, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
    assert (
        len(
            generate(
                stub, f"after-{request_msg.request_id}", [5, 6, 7], max_tokens=2, ignore_eos=True
            )
        )
        >= 1
    )


# The salt as routers send it (RequestContext) and as routers before it did (the loose
# deprecated fields, still read when no context is set): both hash the blocks alike.
@pytest.mark.parametrize("wire", ["context", "legacy"])
def test_kv_events_snapshot_then_numbered_events(
    stub: pb_grpc.WorkerStub, worker: WorkerProcess, wire: str
) -> None:
    seed = stub.Health(pb.HealthRequest()).info.hash_seed
    events = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=30)
    snapshot = next(events)
    assert snapshot.is_snapshot
    start = 7000 if wire == "context" else 7100
    prompt = list(range(start, start + 64))
    req = pb.GenerateRequest(
        request_id=f"events-{wire}",
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True),
    )
    if wire == "context":
        req.context.cache_salt = "tenant-x"
    else:
        req.cache_salt = "tenant-x"
    list(stub.Generate(req, timeout=30))
    batch = next(events)
    assert not batch.is_snapshot
    assert batch.events[0].seq == snapshot.seq + 1
    stored = [h for e in batch.events if e.kind == pb.KV_EVENT_KIND_STORED for h in e.block_hashes]
    assert stored == block_hashes(prompt, block_size=16, seed=seed, salt="tenant-x")
    events.cancel()
    # A new subscriber's snapshot includes those blocks.
    fresh = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(), timeout=30)
    snap = next(fresh)
    assert snap.is_snapshot and set(stored) <= set(snap.snapshot_block_hashes)
    assert snap.instance_id == batch.instance_id
    fresh.cancel()


def test_metrics_health_and_ready_over_http(
    worker: WorkerProcess, stub: pb_grpc.WorkerStub
) -> None:
    generate(stub, "metrics-1", list(range(20)), max_tokens=3, ignore_eos=True)
    base = f"http://127.0.0.1:{worker.metrics_port}"
    body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    for name in (
        "kvflow_worker_requests_waiting",
        "kvflow_worker_kv_cache_usage_ratio",
        "kvflow_worker_prefix_cache_hit_ratio",
        "kvflow_worker_time_to_first_token_seconds_bucket",
        "kvflow_worker_time_per_output_token_seconds_bucket",
        "kvflow_worker_inter_token_latency_seconds_bucket",
        "kvflow_worker_generation_tokens_total",
    ):
        assert name in body, name
    assert urllib.request.urlopen(base + "/health", timeout=10).status == 200
    assert urllib.request.urlopen(base + "/ready", timeout=10).status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/nope", timeout=10)
    assert err.value.code == 404


def test_metrics_the_planner_reads_are_split_by_priority_class(
    worker: WorkerProcess, stub: pb_grpc.WorkerStub
) -> None:
    """The planner sizes for the online classes and drops the batch series
    (docs/planner.md, "Batch work"): a batch request counts under its own label."""
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    families = (names.WORKER_TTFT + "_count", names.WORKER_FINISHED + "_total",
                names.WORKER_PROMPT_TOKENS + "_total")  # fmt: skip
    before = {(f, c): sample(url, f, priority_class=c) for f in families for c in CLASS_WORDS}
    context = pb.RequestContext(priority_class=pb.PRIORITY_CLASS_BATCH)
    req = pb.GenerateRequest(request_id="class-batch-1", prompt_token_ids=list(range(30, 50)),
                             sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True),
                             context=context)  # fmt: skip
    list(stub.Generate(req, timeout=30))
    for family in families:
        grew = {c: sample(url, family, priority_class=c) - before[family, c] for c in CLASS_WORDS}
        assert grew["batch"] > 0 and grew["normal"] == grew["realtime"] == 0, (family, grew)
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    for cls in CLASS_WORDS:  # every class's gauges, from the start
        assert f'{names.WORKER_WAITING}{{priority_class="{cls}"}}' in body
        assert f'{names.WORKER_KV_CLASS_USAGE}{{priority_class="{cls}"}}' in body


def wait_for_http_status(url: str, status: int, timeout_s: float) -> None:
    """Until GET ``url`` answers ``status``; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    got: int | str = "nothing"
    while time.monotonic() < deadline:
        try:
            got = urllib.request.urlopen(url, timeout=5).status
        except urllib.error.HTTPError as err:
            got = err.code
        except OSError as exc:  # the server is gone
            got = repr(exc)
        if got == status:
            return
        time.sleep(0.02)
    raise AssertionError(f"{url} answered {got}, not {status}, for {timeout_s} s")


def test_sigterm_drains_running_requests_then_exits() -> None:
    # 3,000 tokens take about 3 s at 1 ms a step: the drain is checked while it runs.
    num_tokens = 3000
    w = launch_worker(SIM_ARGS, timeout_s=60)
    try:
        with grpc.insecure_channel(w.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            call = stub.Generate(
                pb.GenerateRequest(
                    request_id="drain",
                    prompt_token_ids=[1, 2, 3],
                    sampling=pb.SamplingParams(max_tokens=num_tokens, ignore_eos=True),
                ),
                timeout=60,
            )
            it = iter(call)
            first = next(it)
            w.proc.send_signal(15)
            wait_for_http_status(f"http://127.0.0.1:{w.metrics_port}/ready", 503, timeout_s=10)
            # Draining, not stopped: the request still runs and the server still answers.
            load = stub.Load(pb.LoadRequest(), timeout=5)
            assert load.num_running == 1, load
            with pytest.raises(grpc.RpcError) as refused:
                generate(stub, "late", [1, 2], max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in (refused.value.details() or "")
            rest = list(it)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == num_tokens
        assert w.proc.wait(timeout=30) == 0
    finally:
        w.stop(timeout_s=5)


def test_sigterm_right_after_the_ready_line_is_a_clean_stop() -> None:
    """The stop handler is in place before the worker says it is ready: a kubelet's
    SIGTERM at once after readiness drains and exits 0, not killed by the signal."""
    w = launch_worker(SIM_ARGS, timeout_s=60)
    try:
        w.proc.send_signal(15)
        assert w.proc.wait(timeout=30) == 0
    finally:
        w.stop(timeout_s=5)
