"""The PD fault contract across real worker processes: whatever fails, every reserved block
on both sides is freed (the workers' own Load counters say so), the request is served by the
decode worker alone or fails cleanly, nothing waits past its timeout, and no token comes
from partial or stale KV (outputs equal colocated serving).

A prefill worker started with KVFLOW_FAULT_KV_SEND_PAUSE_S pauses mid-transfer (TCP: after
half the payload; gloo: after joining the pair's group), which is when these tests strike.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from testkit import pd_client as pc
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb

pytestmark = [pytest.mark.integration]

PAUSE_S = 4.0
N_OUT = 8
PROMPT = [(i * 53) % 470 + 7 for i in range(150)]  # 144 tokens to ship: 9 blocks


def start(model: Path, role: str, transport: str, *, slow: bool = False) -> WorkerProcess:
    args = ["--model", str(model), "--role", role, "--kv-transport", transport]
    env = {"KVFLOW_FAULT_KV_SEND_PAUSE_S": str(PAUSE_S)} if slow else None
    return launch_worker([*args, "--num-kv-blocks", "64"], timeout_s=120, env=env)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[int]:
    w = start(tiny_model, "both", "tcp")
    try:
        return pc.colocated(pc.stub(w.address), "ref", PROMPT, N_OUT)
    finally:
        w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def decode(tiny_model: Path) -> Iterator[WorkerProcess]:
    w = start(tiny_model, "decode", "tcp")
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def slow_prefill(tiny_model: Path) -> Iterator[WorkerProcess]:
    w = start(tiny_model, "prefill", "tcp", slow=True)
    yield w
    w.stop(timeout_s=10)


def prefill_in_background(
    prefill: WorkerProcess, rid: str, reservation: pb.KvReservation
) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(
                pc.stub(prefill.address).Prefill(
                    pb.PrefillRequest(
                        request_id=rid, prompt_token_ids=PROMPT, destination=reservation
                    ),
                    timeout=30,
                )
            )
        except grpc.RpcError as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def remote_request(rid: str, timeout_s: float, salt: str = "") -> pb.GenerateRequest:
    """``salt``: a fresh cache namespace, so a decode worker that cached PROMPT lacks it."""
    return pb.GenerateRequest(
        request_id=rid,
        cache_salt=salt,
        prompt_token_ids=PROMPT,
        sampling=pc.greedy(PROMPT, N_OUT),
        remote_prefill=pb.RemotePrefillParams(version=pb.KV_HANDOFF_VERSION_1, timeout_s=timeout_s),
    )


def finish(stream: object) -> tuple[list[int], pb.GenerateResponse]:
    tokens: list[int] = []
    final = None
    for message in stream:  # type: ignore[attr-defined]
        tokens.extend(message.token_ids)
        if message.finish_reason:
            final = message
    assert final is not None
    return tokens, final


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_prefill_killed_mid_transfer_decode_serves_alone(
    tiny_model: Path, reference: list[int], transport: str
) -> None:
    dec = start(tiny_model, "decode", transport)
    try:
        for attempt in ("killed", "fresh"):
            pre = start(tiny_model, "prefill", transport, slow=attempt == "killed")
            try:
                started = time.monotonic()
                request = remote_request(attempt, 20.0, salt=attempt)
                stream = pc.stub(dec.address).Generate(request, timeout=60)
                reservation = next(stream).kv_reservation
                thread, result = prefill_in_background(pre, attempt + "-p", reservation)
                if attempt == "killed":
                    time.sleep(PAUSE_S / 2)  # mid-transfer
                    pre.stop(sig=signal.SIGKILL)
                tokens, final = finish(stream)
                thread.join(30)
                assert tokens == reference
                if attempt == "killed":
                    assert final.usage.remote_tokens == 0  # computed here, not half-received
                    assert time.monotonic() - started < 10.0  # noticed, not the 20 s deadline
                else:  # a new pair (a fresh group under gloo) works after the broken one
                    assert final.usage.remote_tokens == 144, result
                pc.wait_idle(pc.stub(dec.address))
            finally:
                pre.stop(timeout_s=10)
    finally:
        dec.stop(timeout_s=10)


def test_decode_killed_after_reserving_prefill_frees_everything(tiny_model: Path) -> None:
    dec = start(tiny_model, "decode", "tcp")
    pre = start(tiny_model, "prefill", "tcp")
    try:
        stream = pc.stub(dec.address).Generate(remote_request("gone", 20.0), timeout=60)
        reservation = next(stream).kv_reservation
        dec.stop(sig=signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            pc.stub(pre.address).Prefill(
                pb.PrefillRequest(request_id="gone-p", prompt_token_ids=PROMPT,
                                  destination=reservation),
                timeout=30,
            )  # fmt: skip
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5.0
        load = pc.wait_idle(pc.stub(pre.address))
        assert load.num_cached_blocks == 9  # what it computed stays cached, unreferenced
    finally:
        pre.stop(timeout_s=10)
        dec.stop(timeout_s=10)


def test_a_transfer_past_its_timeout_is_computed_by_decode(
    decode: WorkerProcess, slow_prefill: WorkerProcess, reference: list[int]
) -> None:
    started = time.monotonic()
    stream = pc.stub(decode.address).Generate(remote_request("late", 1.0, "late"), timeout=60)
    reservation = next(stream).kv_reservation
    assert reservation.deadline_s == 1.0
    thread, result = prefill_in_background(slow_prefill, "late-p", reservation)
    tokens, final = finish(stream)
    elapsed = time.monotonic() - started
    assert tokens == reference and final.usage.remote_tokens == 0
    assert 1.0 <= elapsed < PAUSE_S  # gave up at its deadline, not at the sender's pace
    thread.join(30)
    [outcome] = result
    assert isinstance(outcome, grpc.RpcError)  # the sender's deadline is the same one
    assert outcome.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    pc.wait_idle(pc.stub(decode.address))
    pc.wait_idle(pc.stub(slow_prefill.address))


def test_no_prefill_ever_comes_decode_computes_at_its_deadline(
    decode: WorkerProcess, reference: list[int]
) -> None:
    started = time.monotonic()
    run = pc.disaggregated(
        pc.stub(decode.address), None, "never", PROMPT, N_OUT, timeout_s=1.0, salt="never"
    )
    assert run.reservation.end_token == 144
    assert run.tokens == reference and run.final is not None
    assert run.final.usage.remote_tokens == 0
    assert 1.0 <= time.monotonic() - started < 5.0
    pc.wait_idle(pc.stub(decode.address))


def test_cancel_kv_transfer_makes_decode_compute_at_once(
    decode: WorkerProcess, reference: list[int]
) -> None:
    """What the router does when the prefill worker is unreachable at rendezvous."""
    started = time.monotonic()
    run = pc.disaggregated(
        pc.stub(decode.address), None, "cancelled", PROMPT, N_OUT, timeout_s=20.0,
        cancel_instead=True, salt="cancelled",
    )  # fmt: skip
    assert run.reservation.end_token == 144
    assert run.tokens == reference and run.final is not None
    assert run.final.usage.remote_tokens == 0
    assert time.monotonic() - started < 5.0
    pc.wait_idle(pc.stub(decode.address))


def test_client_gone_during_transfer_frees_both_sides(
    decode: WorkerProcess, slow_prefill: WorkerProcess
) -> None:
    stream = pc.stub(decode.address).Generate(remote_request("walked", 20.0, "walked"), timeout=60)
    reservation = next(stream).kv_reservation
    thread, result = prefill_in_background(slow_prefill, "walked-p", reservation)
    time.sleep(0.5)
    stream.cancel()  # the router (or its client) went away
    pc.wait_idle(pc.stub(decode.address), timeout_s=5.0)
    thread.join(30)
    [outcome] = result
    assert isinstance(outcome, grpc.RpcError) and outcome.code() == grpc.StatusCode.ABORTED
    pc.wait_idle(pc.stub(slow_prefill.address), timeout_s=5.0)


def test_a_prefill_aborted_mid_send_answers_aborted_and_decode_serves(
    decode: WorkerProcess, slow_prefill: WorkerProcess, reference: list[int]
) -> None:
    """An Abort of a prefill whose send is under way ends it ABORTED (this one request),
    not UNKNOWN, which the router reads as the prefill worker down; the decode worker
    computes the prompt itself."""
    stream = pc.stub(decode.address).Generate(remote_request("cut", 20.0, "cut"), timeout=60)
    reservation = next(stream).kv_reservation
    thread, result = prefill_in_background(slow_prefill, "cut-p", reservation)
    time.sleep(PAUSE_S / 2)  # mid-transfer
    assert pc.stub(slow_prefill.address).Abort(pb.AbortRequest(request_id="cut-p")).found
    thread.join(30)
    [outcome] = result
    assert isinstance(outcome, grpc.RpcError), outcome
    assert outcome.code() == grpc.StatusCode.ABORTED, outcome
    tokens, final = finish(stream)
    assert tokens == reference and final.usage.remote_tokens == 0
    pc.wait_idle(pc.stub(decode.address), timeout_s=5.0)
    pc.wait_idle(pc.stub(slow_prefill.address), timeout_s=5.0)
