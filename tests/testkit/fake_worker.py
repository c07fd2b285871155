"""A scripted gRPC worker in the test process, for failures a real worker will not produce
on cue: refusing every request, dying mid-stream, reporting load it does not have, a
prefill that hangs or fails, a decode worker that dies after reserving. It records every
request, so tests can check exactly what the gateway sent, and counts what it holds
(reservations, prefills), so tests can check that everything was freed.

Prefill/decode: fake workers sharing a `FakeKvFabric` hand "blocks" to each other. A decode
worker asked for a remote prefill answers with a KvReservation for the blocks it lacks,
then waits for them: they land (a prefill worker's Prefill names its reservation), or it
falls back to a local prefill on CancelKvTransfer or its own deadline.

Only for unit-level gateway tests; routing and serving tests use real `kvflow worker`s.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.block_hash import make_hash_seed

BLOCK_SIZE = 16
BYTES_PER_TOKEN = 1024  # what a fake transfer reports sending


class FakeKvFabric:
    """Stands in for the KV transport between fake workers (each serves on its own thread
    and event loop): a decode worker waits on a transfer id, a prefill worker or a
    CancelKvTransfer ends the wait, saying whether the blocks landed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = {}

    def reserve(self, transfer_id: str) -> asyncio.Future[bool]:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiting[transfer_id] = (asyncio.get_running_loop(), future)
        return future

    def end(self, transfer_id: str, *, landed: bool) -> bool:
        """Wake the waiting decode worker; False if nobody waits on ``transfer_id``."""
        with self._lock:
            waiting = self._waiting.pop(transfer_id, None)
        if waiting is None:
            return False
        loop, future = waiting

        def settle() -> None:
            if not future.done():
                future.set_result(landed)

        loop.call_soon_threadsafe(settle)
        return True

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._waiting.pop(transfer_id, None)


@dataclass
class FakeWorker(pb_grpc.WorkerServicer):
    model: str = "fake"
    tokens: Sequence[int] = (1, 2, 3)
    # "ok", "unavailable" (refuse before the first token), "die" (UNAVAILABLE after
    # `die_after` tokens), "invalid" (INVALID_ARGUMENT), "busy" (RESOURCE_EXHAUSTED: a full
    # queue, which leaves the worker healthy), "aborted" (finished as aborted before any token)
    mode: str = "ok"
    die_after: int = 2
    num_running: int = 0  # reported by Load: makes this worker look busy
    # Reported by Load: a waiting queue at its bound (num_waiting >= max_waiting_requests
    # > 0) is one admission control refuses to add to (a 503).
    num_waiting: int = 0
    max_waiting_requests: int = 0
    token_delay_s: float = 0.0
    # The logprob of each token in `tokens` (the last one repeats), sent when the request
    # asks for logprobs; empty: none sent.
    token_logprobs: Sequence[float] = ()
    max_model_len: int = 2048
    role: int = pb.ROLE_COLOCATED
    is_serving: bool = True
    # Advertised in WorkerInfo. Off by default: this worker caches nothing and publishes no
    # STORED events, so a router must not count what it sent here as cached.
    prefix_caching: bool = False
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Part of the model identity it reports (its hash seed): another revision of the model.
    model_revision: str = ""
    # -- decode side of a remote prefill ----------------------------------------------------
    fabric: FakeKvFabric | None = None
    # "ok"; "die" (UNAVAILABLE `die_delay_s` after reserving); "ignore" (no reservation:
    # prefill locally, like a worker that does not disaggregate)
    reserve_mode: str = "ok"
    reserve_delay_s: float = 0.0  # before answering with the reservation
    die_delay_s: float = 0.0
    num_cached_prompt_tokens: int = 0  # the reservation starts here (rounded to blocks)
    reservations: list[pb.KvReservation] = field(default_factory=list)
    cancel_transfer_requests: list[str] = field(default_factory=list)
    # How each wait for blocks ended: "landed", "cancelled" (CancelKvTransfer), "deadline".
    transfer_outcomes: list[str] = field(default_factory=list)
    num_reserved: int = 0  # reservations held right now
    # -- prefill side ---------------------------------------------------------------------
    # One mode per Prefill call, in order, then "ok": "ok", "hang" (until cancelled),
    # "unavailable", "invalid", "aborted".
    prefill_script: list[str] = field(default_factory=list)
    prefill_requests: list[pb.PrefillRequest] = field(default_factory=list)
    num_prefilling: int = 0  # Prefill calls holding blocks right now
    prefill_held_s: dict[str, float] = field(default_factory=dict)  # request id -> how long
    # Request ids of calls the client cancelled (Generate and Prefill).
    cancelled: list[str] = field(default_factory=list)
    _transfer_ids: dict[str, str] = field(default_factory=dict)

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        try:
            if self.mode == "unavailable":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: unavailable")
            if self.mode == "invalid":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake worker: bad request")
            if self.mode == "busy":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake worker: queue full")
            if self.mode == "aborted":  # its step failed before the first token (an engine error)
                yield pb.GenerateResponse(
                    request_id=request.request_id, finish_reason=pb.FINISH_REASON_ABORT
                )
                return
            first_token = remote_tokens = 0
            if request.HasField("remote_prefill") and self.reserve_mode != "ignore":
                reservation = self._reservation(request)
                first_token = reservation.first_token
                await asyncio.sleep(self.reserve_delay_s)
                self.num_reserved += 1
                # Waiting before the reservation leaves: the blocks may land at once.
                assert self.fabric is not None, "a decode fake needs a fabric"
                arrival = self.fabric.reserve(reservation.transfer_id)
                self._transfer_ids[request.request_id] = reservation.transfer_id
                try:
                    yield pb.GenerateResponse(request_id=request.request_id,
                                              kv_reservation=reservation)  # fmt: skip
                    if self.reserve_mode == "die":
                        await asyncio.sleep(self.die_delay_s)
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            "fake worker: died after reserving")  # fmt: skip
                    num_missing = reservation.end_token - reservation.first_token
                    if num_missing and await self._wait_for_blocks(arrival, reservation):
                        remote_tokens = num_missing
                finally:
                    self.num_reserved -= 1
                    self.fabric.forget(reservation.transfer_id)
                    self._transfer_ids.pop(request.request_id, None)
            for i, token in enumerate(self.tokens):
                if self.mode == "die" and i == self.die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: died")
                await asyncio.sleep(self.token_delay_s)
                logprobs = []
                if request.sampling.logprobs and self.token_logprobs:
                    lp = self.token_logprobs[min(i, len(self.token_logprobs) - 1)]
                    logprobs.append(pb.TokenLogprobs(logprob=lp))
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[token],
                                          logprobs=logprobs)  # fmt: skip
            usage = pb.Usage(prompt_tokens=len(request.prompt_token_ids),
                             completion_tokens=len(self.tokens), cached_tokens=first_token,
                             remote_tokens=remote_tokens)  # fmt: skip
            yield pb.GenerateResponse(
                request_id=request.request_id, finish_reason=pb.FINISH_REASON_LENGTH, usage=usage
            )
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    def _reservation(self, request: pb.GenerateRequest) -> pb.KvReservation:
        end = (len(request.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        first = min(self.num_cached_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE, end)
        reservation = pb.KvReservation(
            version=pb.KV_HANDOFF_VERSION_1,
            transfer_id=uuid.uuid4().hex,
            decode_instance_id=self.instance_id,
            transport=pb.KV_TRANSPORT_TCP,
            endpoint="fake:0",
            first_token=first,
            end_token=end,
            kv_layout="fake/B16",
            tag=len(self.reservations) + 1,
            deadline_s=request.remote_prefill.timeout_s,
        )
        self.reservations.append(reservation)
        return reservation

    async def _wait_for_blocks(
        self, arrival: asyncio.Future[bool], reservation: pb.KvReservation
    ) -> bool:
        try:
            async with asyncio.timeout(reservation.deadline_s):
                landed = await arrival
        except TimeoutError:
            self.transfer_outcomes.append("deadline")
            return False
        self.transfer_outcomes.append("landed" if landed else "cancelled")
        return landed

    async def CancelKvTransfer(  # noqa: N802
        self, request: pb.CancelKvTransferRequest, context: Any
    ) -> pb.CancelKvTransferResponse:
        self.cancel_transfer_requests.append(request.request_id)
        transfer_id = self._transfer_ids.get(request.request_id)
        found = self.fabric is not None and transfer_id is not None
        if found:
            assert self.fabric is not None and transfer_id is not None
            found = self.fabric.end(transfer_id, landed=False)
        return pb.CancelKvTransferResponse(found=found)

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:  # noqa: N802
        self.prefill_requests.append(request)
        mode = self.prefill_script.pop(0) if self.prefill_script else "ok"
        self.num_prefilling += 1
        started_s = time.monotonic()
        try:
            if mode == "unavailable":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake prefill: unavailable")
            if mode == "invalid":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake prefill: kv layout")
            if mode == "aborted":
                await context.abort(grpc.StatusCode.ABORTED, "fake prefill: send failed")
            if mode == "hang":
                await asyncio.Event().wait()
            d = request.destination
            assert self.fabric is not None, "a prefill fake needs a fabric"
            self.fabric.end(d.transfer_id, landed=True)
            num_tokens = d.end_token - d.first_token
            return pb.PrefillResponse(
                num_computed_tokens=num_tokens,
                num_sent_blocks=num_tokens // BLOCK_SIZE,
                num_sent_bytes=num_tokens * BYTES_PER_TOKEN,
                prefill_s=0.004,
                transfer_s=0.002,
            )
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.num_prefilling -= 1
            self.prefill_held_s[request.request_id] = time.monotonic() - started_s

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
        return pb.AbortResponse(found=False)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:  # noqa: N802
        info = pb.WorkerInfo(
            instance_id=self.instance_id,
            model=self.model,
            role=self.role,
            block_size=BLOCK_SIZE,
            hash_seed=make_hash_seed(self.model, self.model_revision),
            max_model_len=self.max_model_len,
            num_total_blocks=1024,
            vocab_size=49152,
            eos_token_ids=[2],
            kv_transport=pb.KV_TRANSPORT_TCP,
            prefix_caching=self.prefix_caching,
        )
        return pb.HealthResponse(is_serving=self.is_serving, info=info)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:  # noqa: N802
        # As the engine reports it: running requests decode (the time scorer reads tokens).
        return pb.LoadResponse(
            num_running=self.num_running,
            num_decode_seqs=self.num_running,
            num_total_blocks=1024,
            num_waiting=self.num_waiting,
            max_waiting_requests=self.max_waiting_requests,
        )

    async def SubscribeKvEvents(  # noqa: N802
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.KvEventBatch]:
        yield pb.KvEventBatch(instance_id=self.instance_id, is_snapshot=True, seq=0)
        await asyncio.Event().wait()  # no events, ever


@contextmanager
def running_fake_worker(worker: FakeWorker) -> Iterator[str]:
    """Serve ``worker`` on a loopback port from a background thread; yields "host:port"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server: grpc.aio.Server | None = None

    async def start() -> int:
        nonlocal server
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
