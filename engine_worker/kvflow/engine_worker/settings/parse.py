"""`kvflow worker`'s command line: the flag groups, parsed and checked into WorkerSettings."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvflow.engine_worker.settings.cache_flags import add_cache_flags
from kvflow.engine_worker.settings.checks import flags_problem, kv_tls_problem
from kvflow.engine_worker.settings.model_flags import add_model_flags
from kvflow.engine_worker.settings.record import DEFAULT_GPU_MEMORY_UTILIZATION, WorkerSettings
from kvflow.engine_worker.settings.scheduler_flags import add_scheduler_flags
from kvflow.engine_worker.settings.serving_flags import add_serving_flags
from kvflow.engine_worker.settings.transport_flags import add_transport_flags
from kvflow.engine_worker.tls import TlsFiles
from kvflow.proto.otel import TracingConfig, tracing_config


def parse_args(argv: Sequence[str]) -> WorkerSettings:
    d = WorkerSettings()
    p = argparse.ArgumentParser(
        prog="kvflow worker",
        description="Serve a Llama-family model over gRPC with kvflow's torch engine.",
    )
    for add_flags in (
        add_model_flags,
        add_serving_flags,
        add_scheduler_flags,
        add_cache_flags,
        add_transport_flags,
    ):
        add_flags(p, d)
    a = p.parse_args(list(argv))
    try:
        traces = tracing_config(a.otlp_traces_endpoint, a.otlp_traces_sample_ratio)
    except ValueError as exc:
        p.error(str(exc))
    tls = TlsFiles(a.tls_cert_file, a.tls_key_file, a.tls_ca_file, a.kv_tls, a.kv_tls_server_name)
    problem = flags_problem(a, tls)
    if problem:
        p.error(problem)
    settings = _settings(a, tls, traces)
    problem = kv_tls_problem(a.kv_tls, settings.resolved_kv_transport())
    if problem:
        p.error(problem)
    return settings


def _settings(a: argparse.Namespace, tls: TlsFiles, traces: TracingConfig) -> WorkerSettings:
    return WorkerSettings(
        model=a.model,
        served_model_name=a.served_model_name,
        host=a.host,
        port=a.port,
        metrics_port=a.metrics_port,
        role=a.role,
        device=a.device,
        dtype=a.dtype,
        quantization=a.quantization,
        tensor_parallel_size=a.tensor_parallel_size,
        block_size=a.block_size,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_waiting_requests=a.max_waiting_requests,
        max_queue_time_s=a.max_queue_time_s,
        max_model_len=a.max_model_len,
        kv_cache_gib=a.kv_cache_gib,
        num_kv_blocks=a.num_kv_blocks,
        gpu_memory_utilization=(
            DEFAULT_GPU_MEMORY_UTILIZATION
            if a.gpu_memory_utilization is None
            else a.gpu_memory_utilization
        ),
        kv_cache_dtype=a.kv_cache_dtype,
        decode_workspace_gib=a.decode_workspace_gib,
        paged_attention=not a.no_paged_attention,
        cuda_graphs=a.cuda_graphs,
        enable_prefix_caching=not a.no_prefix_caching,
        simulate=a.simulate,
        sim_profile=a.sim_profile,
        sim_base_step_ms=a.sim_base_step_ms,
        sim_per_token_ms=a.sim_per_token_ms,
        sim_per_seq_ms=a.sim_per_seq_ms,
        drain_timeout_s=a.drain_timeout_s,
        engine_stall_timeout_s=a.engine_stall_timeout_s,
        seed=a.seed,
        kv_transport=a.kv_transport,
        kv_port=a.kv_port,
        advertise_host=a.advertise_host,
        max_kv_transfer_timeout_s=a.max_kv_transfer_timeout_s,
        kv_peer_allow=a.kv_peer_allow,
        grammar_cache_mib=a.grammar_cache_mib,
        tls=tls,
        tracing=traces,
        task=a.task,
        max_embedding_inputs=a.max_embedding_inputs,
        max_embedding_input_tokens=a.max_embedding_input_tokens,
    )
