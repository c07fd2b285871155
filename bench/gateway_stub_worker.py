"""A stub worker for the gateway benchmark: the kvflow.worker.v1 contract with no engine.

Generate streams ``max_tokens`` tokens (default 16) one message each, instantly, then the
final message with usage; every prompt's full blocks are published as a STORED KV event,
so the gateway's index and event handling do their real work. Run as a process:

    python bench/gateway_stub_worker.py --port 0 --model stub

prints ``STUB_WORKER_READY port=N`` when it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.block_hash import block_hashes, make_hash_seed

BLOCK_SIZE = 16


class StubWorker(pb_grpc.WorkerServicer):
    def __init__(self, model: str) -> None:
        self.info = pb.WorkerInfo(
            instance_id=uuid.uuid4().hex,
            model=model,
            role=pb.ROLE_COLOCATED,
            block_size=BLOCK_SIZE,
            hash_seed=make_hash_seed(model),
            max_model_len=16384,
            num_total_blocks=1 << 16,
            vocab_size=49152,
            eos_token_ids=[2],
            prefix_caching=True,  # it publishes STORED events for every prompt
        )
        self.num_running = 0
        self.seq = 0
        self.subscribers: list[asyncio.Queue[pb.KvEventBatch]] = []

    def _publish(self, request: pb.GenerateRequest) -> None:
        hashes = block_hashes(
            request.prompt_token_ids,
            block_size=BLOCK_SIZE,
            seed=self.info.hash_seed,
            salt=request.context.cache_salt,
            num_public_blocks=request.context.num_public_blocks,
        )
        if not hashes:
            return
        self.seq += 1
        batch = pb.KvEventBatch(instance_id=self.info.instance_id, seq=self.seq)
        batch.events.add(seq=self.seq, kind=pb.KV_EVENT_KIND_STORED, block_hashes=hashes)
        for queue in self.subscribers:
            queue.put_nowait(batch)

    async def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.num_running += 1
        try:
            num_tokens = (
                request.sampling.max_tokens if request.sampling.HasField("max_tokens") else 16
            )
            for i in range(num_tokens):
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[300 + i])
            self._publish(request)
            yield pb.GenerateResponse(
                request_id=request.request_id,
                finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(
                    prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens
                ),
            )
        finally:
            self.num_running -= 1

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
        return pb.AbortResponse(found=False)

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:  # noqa: N802
        return pb.HealthResponse(is_serving=True, info=self.info)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:  # noqa: N802
        return pb.LoadResponse(num_running=self.num_running, num_total_blocks=1 << 16)

    async def SubscribeKvEvents(  # noqa: N802
        self, request: pb.SubscribeKvEventsRequest, context: Any
    ) -> AsyncIterator[pb.KvEventBatch]:
        queue: asyncio.Queue[pb.KvEventBatch] = asyncio.Queue()
        self.subscribers.append(queue)
        try:
            yield pb.KvEventBatch(instance_id=self.info.instance_id, is_snapshot=True, seq=self.seq)
            while True:
                yield await queue.get()
        finally:
            self.subscribers.remove(queue)


async def serve(host: str, port: int, model: str) -> None:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(StubWorker(model), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    print(f"STUB_WORKER_READY port={bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="stub")
    args = p.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.host, args.port, args.model))


if __name__ == "__main__":
    main()
