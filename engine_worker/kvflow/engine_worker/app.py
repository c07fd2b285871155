"""Assemble a worker from its settings and serve it until SIGTERM (then drain)."""

from __future__ import annotations

import logging
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, ModelRunner
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.peers import PeerAllowList
from kvflow.engine_worker.listen import bind_grpc, bind_http, binding, grpc_server
from kvflow.engine_worker.liveness import EngineHeartbeat
from kvflow.engine_worker.loop_records import BlockIO
from kvflow.engine_worker.memory.report import MemoryReport
from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.engine_worker.server import WorkerService
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.engine_worker.sim_runner import SimulatedRunner, StepTiming
from kvflow.engine_worker.stopping import drain, stop_on_signal
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.block_hash import make_hash_seed
from kvflow.proto.transports import KvTransport

log = logging.getLogger("kvflow.worker")

GIB = 1024**3

# A simulated worker pretends to be SmolLM2-135M-Instruct: its vocabulary, EOS and
# context, and its KV bytes per block in float32 (2 x 30 layers x 16 x 3 heads x 64 x 4 B).
SIM_VOCAB_SIZE = 49152
SIM_EOS_TOKEN_IDS: tuple[int, ...] = (2,)
SIM_MAX_MODEL_LEN = 8192
SIM_BYTES_PER_BLOCK_PER_TOKEN = 2 * 30 * 3 * 64 * 4


class BlockRunner(ModelRunner, BlockIO, Protocol):
    """A runner that also reads and writes whole blocks for PD (both runners do)."""


@dataclass
class BuiltWorker:
    engine: Engine
    info: pb.WorkerInfo
    runner: BlockRunner
    memory: MemoryReport
    ranks: TensorParallelRanks | None = None  # the ranks this worker leads (tp/leader.py)

    def problem(self) -> str | None:
        """Why the runner cannot compute (a tensor-parallel rank that exited), or None."""
        return None if self.ranks is None else self.ranks.followers.problem()

    def close(self) -> None:
        """Stop what the worker started (its tensor-parallel ranks)."""
        if self.ranks is not None:
            self.ranks.close()


class _Followers(Protocol):
    def problem(self) -> str | None: ...


class TensorParallelRanks(Protocol):
    """What the worker holds of the ranks it leads (``tp.leader.LeaderGroup``)."""

    followers: _Followers

    def close(self) -> None: ...


def num_kv_blocks(settings: WorkerSettings, bytes_per_block: int) -> int:
    if settings.num_kv_blocks is not None:
        return settings.num_kv_blocks
    gib = settings.cpu_kv_cache_gib()
    num = int(gib * GIB // bytes_per_block)
    if num < 1:
        raise SystemExit(
            f"--kv-cache-gib {gib} holds no block of {bytes_per_block} bytes; raise it"
        )
    return num


def _simulated_geometry(settings: WorkerSettings) -> tuple[StepTiming, int, int]:
    """A simulated worker's step timing, KV bytes per block and block count: from its
    profile, or the legacy --sim-*-ms flags and SmolLM2's float32 KV."""
    legacy = StepTiming.legacy(
        settings.sim_base_step_ms / 1e3,
        settings.sim_per_token_ms / 1e3,
        settings.sim_per_seq_ms / 1e3,
    )
    if settings.sim_profile is None:
        per_block = SIM_BYTES_PER_BLOCK_PER_TOKEN * settings.block_size
        return legacy, per_block, num_kv_blocks(settings, per_block)
    if not legacy.is_zero:
        raise SystemExit("--sim-profile sets the step timing: drop the --sim-*-ms flags")
    try:
        profile = resolve_profile(settings.sim_profile)
    except ProfileError as exc:
        raise SystemExit(f"--sim-profile: {exc}") from None
    per_block = profile.kv_bytes_per_block // profile.block_size * settings.block_size
    num_blocks = settings.num_kv_blocks
    if num_blocks is None:
        num_blocks = profile.num_kv_blocks * profile.block_size // settings.block_size
    return profile.timing, per_block, num_blocks


def _start_tensor_parallel(settings: WorkerSettings) -> Any:
    """Check the model splits, then spawn the other ranks and form the group with them."""
    import torch

    from kvflow.engine_worker.model.errors import ModelLoadError
    from kvflow.engine_worker.model.loader import model_config
    from kvflow.engine_worker.model.shard import tensor_parallel_problem
    from kvflow.engine_worker.tp.leader import start_ranks, threads_per_rank

    size = settings.tensor_parallel_size
    problem = tensor_parallel_problem(model_config(settings.model), size)
    if problem is not None:
        raise ModelLoadError(problem)
    if not settings.device.startswith("cuda"):
        torch.set_num_threads(threads_per_rank(size))
    return start_ranks(settings)


def build_worker(settings: WorkerSettings, *, loaded: tuple[Any, Any] | None = None) -> BuiltWorker:
    """Load the model (or the simulator) and size the KV cache; slow for a real model.

    ``loaded`` is a ``(model, config)`` pair from ``load_model`` to reuse (tests build
    several engines over one model).
    """
    runner: BlockRunner
    leader = None
    if settings.simulate:
        name = settings.served_model_name or "simulated"
        vocab, eos, model_len = SIM_VOCAB_SIZE, SIM_EOS_TOKEN_IDS, SIM_MAX_MODEL_LEN
        timing, per_block, num_blocks = _simulated_geometry(settings)
        runner = SimulatedRunner(
            vocab_size=vocab,
            eos_token_ids=eos,
            timing=timing,
            kv_bytes_per_block=per_block,
            block_size=settings.block_size,
        )
        how = "--num-kv-blocks" if settings.num_kv_blocks is not None else "simulated"
        memory = MemoryReport({}, "simulated", num_blocks * per_block, num_blocks,
                              settings.block_size, how)  # fmt: skip
    else:
        from kvflow.engine_worker.torch_worker import load_weights_for, make_runner

        if settings.tensor_parallel_size > 1 and loaded is None:
            leader = _start_tensor_parallel(settings)
        try:
            model, config, dtype = load_weights_for(
                settings, loaded, tp=None if leader is None else leader.group.ranks
            )
            name = settings.served_model_name or config.name
            vocab, eos, model_len = (
                config.vocab_size,
                config.eos_token_ids,
                config.max_position_embeddings,
            )
            built = make_runner(settings, model, config, dtype, rank=0)
            runner, num_blocks, memory = built.runner, built.num_blocks, built.memory
            if leader is not None:
                from kvflow.engine_worker.tp.leader import LOAD_TIMEOUT_S, TensorParallelRunner

                leader.group.wait_ready(leader.followers.problem, LOAD_TIMEOUT_S)
                runner = TensorParallelRunner(built.runner, leader, built.whole_kv_layout)
        except BaseException:
            if leader is not None:
                leader.close()
            raise
    log.info("%s", memory.log_line())

    max_model_len = min(settings.max_model_len or model_len, model_len)
    hash_seed = make_hash_seed(name, f"vocab={vocab}")
    engine = Engine(
        EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=settings.max_num_batched_tokens,
                max_num_seqs=settings.max_num_seqs,
                max_model_len=max_model_len,
                block_size=settings.block_size,
                max_waiting_requests=settings.max_waiting_requests,
                max_queue_time_s=settings.max_queue_time_s,
            ),
            num_kv_blocks=num_blocks,
            vocab_size=vocab,
            eos_token_ids=tuple(eos),
            hash_seed=hash_seed,
            enable_prefix_caching=settings.enable_prefix_caching,
        ),
        runner,
    )
    info = pb.WorkerInfo(
        instance_id=uuid.uuid4().hex,
        model=name,
        role=settings.role.to_pb(),
        block_size=settings.block_size,
        hash_seed=hash_seed,
        max_model_len=engine.max_len,
        num_total_blocks=num_blocks,
        vocab_size=vocab,
        eos_token_ids=list(eos),
        kv_transport=KvTransport(settings.resolved_kv_transport()).to_pb(),
        prefix_caching=settings.enable_prefix_caching,
    )
    return BuiltWorker(engine, info, runner, memory, leader)


def advertised_host(settings: WorkerSettings) -> str:
    if settings.advertise_host:
        return settings.advertise_host
    if settings.host not in ("0.0.0.0", "::", ""):
        return settings.host
    return socket.gethostbyname(socket.gethostname())


def start_kv_agent(settings: WorkerSettings, instance_id: str) -> KvTransferAgent:
    kind = KvTransport(settings.resolved_kv_transport())
    transport = make_transport(
        kind,
        host=settings.host,
        port=settings.kv_port,
        advertise_host=advertised_host(settings),
        instance_id=instance_id,
        peer_allow=PeerAllowList.parse(settings.kv_peer_allow),
        tls=settings.tls.kv_tls(),
    )
    # Every request waiting for KV holds a seat (scheduler.py): no more receives can pend.
    return KvTransferAgent(
        transport,
        instance_id=instance_id,
        max_timeout_s=settings.max_kv_transfer_timeout_s,
        max_receives=settings.max_num_seqs,
    )


async def serve(settings: WorkerSettings) -> None:
    built = build_worker(settings)
    metrics = WorkerMetrics()
    # A simulated worker holds no device memory: its accounting is reported as the CPU's.
    metrics.observe_memory(built.memory, "cpu" if settings.simulate else settings.device)
    kv = binding(
        "KV transfer",
        "--kv-port",
        settings.kv_port,
        lambda: start_kv_agent(settings, built.info.instance_id),
    )
    heartbeat = EngineHeartbeat(settings.engine_stall_timeout_s)
    heartbeat.also_check(built.problem)
    loop = EngineLoop(
        built.engine,
        on_step=metrics.observe_step,
        on_transfer=metrics.observe_transfer,
        kv=kv,
        blocks=built.runner,
        heartbeat=heartbeat,
    )
    loop.start()

    server = grpc_server()
    structured = None
    if not settings.simulate:
        from kvflow.engine_worker.structured.service import StructuredOutputs

        structured = StructuredOutputs(
            settings.model,
            built.info.vocab_size,
            built.info.eos_token_ids,
            cache_bytes=settings.grammar_cache_mib * 1024 * 1024,
        )
    service = WorkerService(loop, built.info, built.runner.kv_layout, structured, metrics)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    port = bind_grpc(server, settings)
    http = bind_http(
        settings,
        metrics.registry,
        is_ready=lambda: not loop.is_draining,
        health_problem=loop.heartbeat.problem,
    )
    await server.start()
    metrics_port = http.server_address[1]
    log.info(
        "serving %s: gRPC %s:%d, HTTP %s:%d (/metrics /health /ready)",
        built.info.model,
        settings.host,
        port,
        settings.host,
        metrics_port,
    )
    stop = stop_on_signal()  # before the ready line: a SIGTERM after it drains
    # One machine-readable line for whoever started us with port 0 (tests, `kvflow up`).
    print(
        f"KVFLOW_WORKER_READY grpc_port={port} metrics_port={metrics_port} "
        f"kv_port={kv.endpoint.rpartition(':')[2]}",
        flush=True,
    )

    await stop.wait()

    # Drain: refuse new requests (readiness fails, Generate says UNAVAILABLE), let
    # running ones finish, then stop.
    loop.is_draining = True
    log.info("draining %d requests (up to %.0f s)", loop.num_in_flight, settings.drain_timeout_s)
    await drain(lambda: loop.num_in_flight, settings.drain_timeout_s)
    await server.stop(grace=1.0)
    http.shutdown()
    loop.stop()
    kv.close()
    built.close()
    log.info("stopped")
