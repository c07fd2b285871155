"""Drive the PD handoff between real worker processes over gRPC, as a router does."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc


@dataclass
class PdRun:
    reservation: pb.KvReservation
    tokens: list[int] = field(default_factory=list)
    final: pb.GenerateResponse | None = None
    prefill: pb.PrefillResponse | None = None
    prefill_error: grpc.RpcError | None = None


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Sends the pool's worker token, as a router does."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _with_token(self, details):  # type: ignore[no-untyped-def]
        return details._replace(metadata=[*(details.metadata or ()), self._metadata])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)


def stub(address: str, token: str | None = None) -> pb_grpc.WorkerStub:
    channel = grpc.insecure_channel(address)
    if token is not None:
        channel = grpc.intercept_channel(channel, _Bearer(token))
    return pb_grpc.WorkerStub(channel)


def greedy(prompt: list[int], max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def colocated(worker: pb_grpc.WorkerStub, rid: str, prompt: list[int], n: int) -> list[int]:
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=greedy(prompt, n))
    return [t for m in worker.Generate(req, timeout=120) for t in m.token_ids]


def disaggregated(
    decode: pb_grpc.WorkerStub,
    prefill: pb_grpc.WorkerStub | None,
    rid: str,
    prompt: list[int],
    n: int,
    *,
    timeout_s: float = 20.0,
    cancel_instead: bool = False,
    salt: str = "",
) -> PdRun:
    """Reserve on decode, prefill and send, read decode's tokens. ``prefill`` None: never
    call Prefill (decode must fall back at its deadline); ``cancel_instead``: call
    CancelKvTransfer instead of Prefill."""
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        cache_salt=salt,
        sampling=greedy(prompt, n),
        remote_prefill=pb.RemotePrefillParams(version=pb.KV_HANDOFF_VERSION_1, timeout_s=timeout_s),
    )
    stream = decode.Generate(req, timeout=120)
    first = next(stream)
    assert first.HasField("kv_reservation") and not first.token_ids
    run = PdRun(first.kv_reservation)
    thread = None
    has_blocks = run.reservation.end_token > run.reservation.first_token
    if has_blocks and cancel_instead:
        decode.CancelKvTransfer(pb.CancelKvTransferRequest(request_id=rid), timeout=10)
    elif has_blocks and prefill is not None:

        def call_prefill() -> None:
            try:
                run.prefill = prefill.Prefill(
                    pb.PrefillRequest(
                        request_id=rid + "-p",
                        prompt_token_ids=prompt,
                        cache_salt=salt,
                        destination=run.reservation,
                    ),
                    timeout=60,
                )
            except grpc.RpcError as exc:
                run.prefill_error = exc

        thread = threading.Thread(target=call_prefill)
        thread.start()
    for message in stream:
        run.tokens.extend(message.token_ids)
        if message.finish_reason:
            run.final = message
    if thread is not None:
        thread.join(60)
    return run


def wait_idle(worker: pb_grpc.WorkerStub, timeout_s: float = 20.0) -> pb.LoadResponse:
    """Until nothing runs, waits, transfers or holds a block; then the load."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = worker.Load(pb.LoadRequest(), timeout=5)
        if (
            load.num_running == 0
            and load.num_waiting == 0
            and load.num_kv_transfers == 0
            and load.kv_usage == 0.0
        ):
            return load
        assert time.monotonic() < deadline, f"worker still holds work: {load}"
        time.sleep(0.05)
