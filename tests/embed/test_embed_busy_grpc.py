"""A busy embedding worker refuses over real gRPC as a generating one does: RESOURCE_EXHAUSTED
with gRFC A6's pushback, which the router's parser reads back (then it fails over or answers
503 with Retry-After), and the worker serves the next request."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvflow.engine_worker.embed.model import StaticEmbedder
from kvflow.engine_worker.embed.model_files import embedding_model_files
from kvflow.engine_worker.embed.server import EmbedWorkerService
from kvflow.engine_worker.embed.service import RETRY_AFTER_S, EmbedLimits, EmbedService
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.pushback import pushback_s


def _request(*texts: str) -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts])


def test_a_full_embedding_worker_answers_resource_exhausted_with_its_pushback() -> None:
    model = StaticEmbedder.load(embedding_model_files(None))
    service = EmbedService(model, EmbedLimits(max_waiting_requests=1))

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_WorkerServicer_to_server(
            EmbedWorkerService(service, pb.WorkerInfo(model="wordllama")), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.WorkerStub(channel)
                first = asyncio.ensure_future(stub.Embed(_request(*["x " * 2000] * 64)))
                while service.num_in_flight == 0:
                    await asyncio.sleep(0.001)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Embed(_request("y"))
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "1 requests in flight" in (refused.value.details() or "")
                trailers = refused.value.trailing_metadata() or ()
                assert pushback_s(list(trailers)) == pytest.approx(RETRY_AFTER_S, abs=1e-3)
                assert len((await first).embeddings) == 64
                assert len((await stub.Embed(_request("hello world"))).embeddings) == 1
        finally:
            await server.stop(None)

    try:
        asyncio.run(run())
    finally:
        service.close()
