"""`kvflow worker --task embed`: load an embedding model and serve Embed until SIGTERM."""

from __future__ import annotations

import logging
import uuid

from kvflow.engine_worker.embed.model import StaticEmbedder
from kvflow.engine_worker.embed.model_files import embedding_model_files
from kvflow.engine_worker.embed.server import EmbedWorkerService
from kvflow.engine_worker.embed.service import EmbedLimits, EmbedMetrics, EmbedService
from kvflow.engine_worker.listen import PortTakenError, bind_grpc, bind_http, grpc_server
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.stopping import drain, stop_on_signal
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

log = logging.getLogger("kvflow.worker")

__all__ = ["PortTakenError", "build_embed_service", "serve_embed"]


def build_embed_service(settings: WorkerSettings) -> tuple[EmbedService, pb.WorkerInfo]:
    """Load the model and describe it for routers (its task, dimensions and limits)."""
    model = StaticEmbedder.load(embedding_model_files(settings.model), settings.device)
    limits = EmbedLimits(
        max_inputs=settings.max_embedding_inputs,
        max_input_tokens=settings.max_embedding_input_tokens,
        max_waiting_requests=settings.max_waiting_requests or EmbedLimits().max_waiting_requests,
    )
    info = pb.WorkerInfo(
        instance_id=uuid.uuid4().hex,
        model=settings.served_model_name or model.name,
        role=pb.ROLE_COLOCATED,
        vocab_size=model.vocab_size,
        max_model_len=limits.max_input_tokens,
        task=pb.TASK_EMBED,
        embedding=pb.EmbeddingInfo(
            dimensions=model.dimensions,
            allowed_dimensions=list(model.allowed_dimensions),
            max_inputs=limits.max_inputs,
            max_input_tokens=limits.max_input_tokens,
        ),
    )
    return EmbedService(model, limits), info


# A static model's batch is a gather and a sum, bound by memory, not compute: one torch
# thread embeds 64 short texts in 1 ms where two took 16 ms (the second thread's wake-up
# after each tokenization), and 2048 long ones in 23 ms against 44 ms (2-core VM;
# docs/benchmarks.md, "Embeddings").
EMBED_TORCH_THREADS = 1


async def serve_embed(settings: WorkerSettings) -> None:
    import torch

    if not settings.device.startswith("cuda"):
        torch.set_num_threads(EMBED_TORCH_THREADS)
    service, info = build_embed_service(settings)
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    service.metrics = EmbedMetrics(registry)
    grpc_service = EmbedWorkerService(service, info)
    server = grpc_server()
    pb_grpc.add_WorkerServicer_to_server(grpc_service, server)
    port = bind_grpc(server, settings)
    http = bind_http(settings, registry, is_ready=lambda: not grpc_service.is_draining)
    await server.start()
    metrics_port = http.server_address[1]
    dims = info.embedding
    log.info(
        "serving embeddings of %s (%d dimensions, also %s): gRPC %s:%d, HTTP %s:%d",
        info.model, dims.dimensions, list(dims.allowed_dimensions),
        settings.host, port, settings.host, metrics_port,
    )  # fmt: skip
    stop = stop_on_signal()  # before the ready line: a SIGTERM after it drains
    # The same machine-readable line as a generating worker (no KV port: kv_port=0).
    print(f"KVFLOW_WORKER_READY grpc_port={port} metrics_port={metrics_port} kv_port=0", flush=True)

    await stop.wait()
    grpc_service.is_draining = True
    await drain(lambda: service.num_in_flight, settings.drain_timeout_s)
    await server.stop(grace=1.0)
    http.shutdown()
    service.close()
    log.info("stopped")
