"""A scripted gRPC worker in the test process, for failures a real worker will not produce
on cue: refusing every request, dying mid-stream, reporting load it does not have. It also
records every GenerateRequest, so tests can check exactly what the gateway sent.

Only for unit-level gateway tests; routing and serving tests use real `kvflow worker`s.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.block_hash import make_hash_seed


@dataclass
class FakeWorker(pb_grpc.WorkerServicer):
    model: str = "fake"
    tokens: Sequence[int] = (1, 2, 3)
    # "ok", "unavailable" (refuse before the first token), "die" (UNAVAILABLE after
    # `die_after` tokens), "invalid" (INVALID_ARGUMENT)
    mode: str = "ok"
    die_after: int = 2
    num_running: int = 0  # reported by Load: makes this worker look busy
    token_delay_s: float = 0.0
    max_model_len: int = 2048
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: unavailable")
        if self.mode == "invalid":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake worker: bad request")
        for i, token in enumerate(self.tokens):
            if self.mode == "die" and i == self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: died")
            await asyncio.sleep(self.token_delay_s)
            yield pb.GenerateResponse(request_id=request.request_id, token_ids=[token])
        yield pb.GenerateResponse(
            request_id=request.request_id,
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(
                prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.tokens)
            ),
        )

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
        return pb.AbortResponse(found=False)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:  # noqa: N802
        info = pb.WorkerInfo(
            instance_id=self.instance_id,
            model=self.model,
            role=pb.ROLE_BOTH,
            block_size=16,
            hash_seed=make_hash_seed(self.model),
            max_model_len=self.max_model_len,
            num_total_blocks=1024,
            vocab_size=49152,
            eos_token_ids=[2],
        )
        return pb.HealthResponse(is_serving=True, info=info)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:  # noqa: N802
        return pb.LoadResponse(num_running=self.num_running, num_total_blocks=1024)

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
