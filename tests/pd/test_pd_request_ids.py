"""A request id reused across concurrent disaggregated requests, on real worker processes:
each worker refuses the duplicate (INVALID_ARGUMENT, which a router answers with a 4xx)
without touching the request that holds the id, which completes; both workers stay
healthy and hold nothing afterwards.

Simulated workers (real scheduler, blocks, server and TCP transport; a step of 16 tokens
takes 150 ms) make the window in which the duplicate arrives wide and the start cheap."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from testkit import pd_client as pc
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb

pytestmark = [pytest.mark.integration]

TOKEN = "pool-token"
PROMPT = [(i * 53) % 470 + 7 for i in range(70)]  # 64 tokens to ship: 4 blocks
SIM = [
    "--simulate", "--sim-base-step-ms", "150", "--max-num-batched-tokens", "16",
    "--num-kv-blocks", "64", "--kv-transport", "tcp",
]  # fmt: skip


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    env = {"KVFLOW_WORKER_TOKEN": TOKEN}
    workers = [
        launch_worker([*SIM, "--role", r], timeout_s=60, env=env) for r in ("prefill", "decode")
    ]
    yield workers[0], workers[1]
    for w in workers:
        w.stop(timeout_s=10)


def remote_request(rid: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        cache_salt=rid,
        prompt_token_ids=PROMPT,
        sampling=pc.greedy(PROMPT, 4),
        remote_prefill=pb.RemotePrefillParams(version=pb.KV_HANDOFF_VERSION_1, timeout_s=20),
    )


def test_one_id_twice_on_both_workers(pair: tuple[WorkerProcess, WorkerProcess]) -> None:
    prefill, decode = (pc.stub(w.address, TOKEN) for w in pair)
    stream = decode.Generate(remote_request("same"), timeout=60)
    first = next(stream)
    assert first.HasField("kv_reservation") and first.kv_reservation.end_token == 64

    # Decode: a second stream under the id is refused, the first keeps its reservation.
    with pytest.raises(grpc.RpcError) as refused:
        list(decode.Generate(remote_request("same"), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already running" in (refused.value.details() or "")

    # Prefill: the original is admitted (a step takes 150 ms), then a duplicate naming
    # another destination arrives; it must neither replace nor delete the original's.
    results: list[object] = []

    def original() -> None:
        request = pb.PrefillRequest(
            request_id="same", prompt_token_ids=PROMPT, cache_salt="same",
            destination=first.kv_reservation,
        )  # fmt: skip
        try:
            results.append(prefill.Prefill(request, timeout=30))
        except grpc.RpcError as exc:
            results.append(exc)

    thread = threading.Thread(target=original)
    thread.start()
    deadline = time.monotonic() + 10
    while prefill.Load(pb.LoadRequest(), timeout=5).num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    elsewhere = pb.KvReservation()
    elsewhere.CopyFrom(first.kv_reservation)
    elsewhere.transfer_id, elsewhere.endpoint = "x-1", "127.0.0.1:9"
    duplicate = pb.PrefillRequest(
        request_id="same", prompt_token_ids=PROMPT, cache_salt="same", destination=elsewhere
    )
    with pytest.raises(grpc.RpcError) as refused:
        prefill.Prefill(duplicate, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    thread.join(30)
    assert isinstance(results[0], pb.PrefillResponse), results
    assert results[0].num_sent_blocks == 4
    tokens, final = [], None
    for message in stream:
        tokens += message.token_ids
        final = message if message.finish_reason else final
    assert len(tokens) == 4 and final is not None and final.usage.remote_tokens == 64

    # Both workers healthy, idle, and serving the next disaggregated request.
    for worker in (prefill, decode):
        assert worker.Health(pb.HealthRequest(), timeout=5).is_serving
        pc.wait_idle(worker)
    run = pc.disaggregated(decode, prefill, "next", PROMPT, 4, salt="next")
    assert len(run.tokens) == 4 and run.prefill is not None, run.prefill_error
