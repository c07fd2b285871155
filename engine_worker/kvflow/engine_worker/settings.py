"""`kvflow worker` settings: one typed record, parsed from the command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.engine_worker.kv_transfer.peers import PeerAllowList
from kvflow.engine_worker.tls import KV_TLS_MODES, TlsFiles
from kvflow.proto.block_hash import DEFAULT_BLOCK_SIZE
from kvflow.proto.otel import TracingConfig, tracing_config
from kvflow.proto.roles import ROLE_WORDS, Role
from kvflow.proto.transports import KV_TRANSPORT_CHOICES

# auto: the checkpoint's dtype where the device computes it natively, else float32
# (auto_dtype.py). No float16: the loader runs none (some checkpoints' activations overflow
# it), so the command line refuses it up front rather than after parsing the weights.
DTYPES = ("auto", "float32", "bfloat16")
# auto: a GGUF's quantized matrices stay quantized (4-bit planes multiplied by torch's int4
# kernels: model/quant/); none: widened to --dtype at load, as before; fp8: a float
# checkpoint's projections quantized to e4m3 at load (GPUs with FP8 tensor cores).
QUANTIZATIONS = ("auto", "none", "fp8")
# auto: the model's dtype; int8 and fp8 (e4m3): one byte per value and a float16 scale per
# token and head (model/kv_quant.py), 1.94x the tokens of a bf16 cache per byte.
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# A CPU worker's KV cache without --kv-cache-gib; a CUDA one is sized by utilization.
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# vLLM's default: the fraction of a GPU's memory a worker takes (weights, activations, cache).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# `kvflow worker`'s queue bound: a full default batch four deep (256 behind 64 running),
# minutes of queue on a CPU, tens of seconds on a GPU. Past it a request is refused at once
# (RESOURCE_EXHAUSTED, with a retry-after) and the router tries another worker or answers 503.
DEFAULT_MAX_WAITING_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    model: str | None = None  # HF folder or .gguf; None: the built-in SmolLM2-135M-Instruct
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC; 0 picks a free port
    metrics_port: int = 9400  # HTTP /metrics /health /ready; 0 picks a free port
    role: Role = Role.COLOCATED
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "auto"
    # Ranks the model splits over (tp/): this process and N - 1 it spawns, one device each.
    tensor_parallel_size: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # None: unbounded, for engines built in-process (profiling, calibration) that study
    # queueing; the command line's default is DEFAULT_MAX_WAITING_REQUESTS.
    max_waiting_requests: int | None = None
    max_queue_time_s: float | None = None  # also refuse past this estimated wait
    max_model_len: int | None = None  # None: the model's own limit
    # None: DEFAULT_CPU_KV_CACHE_GIB on the CPU; on CUDA what gpu_memory_utilization leaves
    # once the weights and a peak forward are measured (memory/measure.py).
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_gib
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # Dense copies of decoding sequences' K/V so decode attention gathers nothing
    # (model/decode_workspace.py). None: kv_cache_gib on CPU, 0 (off) on CUDA, where the
    # memory is better spent on the cache.
    decode_workspace_gib: float | None = None
    # Pure decode steps replayed from CUDA graphs (model/decode_graphs.py). The command line
    # takes it on CUDA devices only; built in-process on a CPU, the same padded steps run
    # eagerly (how the tests check the path).
    cuda_graphs: bool = False
    enable_prefix_caching: bool = True
    simulate: bool = False
    # A profile's name (h100-llama3-8b...) or a file `kvflow profile` wrote: the step
    # timing, KV bytes per block and block count of that GPU and model.
    sim_profile: str | None = None
    sim_base_step_ms: float = 0.0
    sim_per_token_ms: float = 0.0
    sim_per_seq_ms: float = 0.0
    drain_timeout_s: float = 30.0
    engine_stall_timeout_s: float = 60.0  # /health fails when one step runs longer
    seed: int = 0
    kv_transport: str = "auto"  # auto: nccl on CUDA, tcp on CPU
    kv_port: int = 50052  # KV receiver (tcp) or rendezvous store (gloo, nccl); 0: any free
    advertise_host: str | None = None  # how peers reach kv_port; None: from --host
    max_kv_transfer_timeout_s: float = 30.0
    # Networks (CIDRs) this worker sends KV to; "" allows any (kv_transfer/peers.py).
    kv_peer_allow: str = ""
    # Memory for compiled structured-output formats, an LRU (structured/grammar.py's
    # DEFAULT_CACHE_MIB; not imported here: parsing flags loads no grammar engine).
    grammar_cache_mib: int = 64
    # Worker gRPC over TLS from files; with a CA, mutual TLS (tls.py). Off by default.
    tls: TlsFiles = field(default_factory=TlsFiles)
    # OpenTelemetry spans of traced requests (tracing.py): off unless an endpoint is given.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # "generate" (the engine) or "embed" (an embedding model, embed/; docs/engine.md).
    task: str = "generate"
    # Embed requests: inputs per request and tokens per input (OpenAI's limits).
    max_embedding_inputs: int = 2048
    max_embedding_input_tokens: int = 8192

    def resolved_decode_workspace_gib(self) -> float:
        if self.decode_workspace_gib is not None:
            return self.decode_workspace_gib
        if self.device.startswith("cuda") or self.cuda_graphs:
            return 0.0
        return self.cpu_kv_cache_gib()

    def cpu_kv_cache_gib(self) -> float:
        """The cache's size where it is not sized by utilization (the CPU, a simulator)."""
        return DEFAULT_CPU_KV_CACHE_GIB if self.kv_cache_gib is None else self.kv_cache_gib

    def resolved_kv_transport(self) -> str:
        if self.kv_transport != "auto":
            return self.kv_transport
        # On CPU the TCP stream moves blocks in place (no gather, no scatter): 87-98 % of
        # the loopback ceiling against gloo's 51-64 % (docs/benchmarks.md, "KV transfer").
        return "nccl" if self.device.startswith("cuda") else "tcp"


def parse_args(argv: Sequence[str]) -> WorkerSettings:
    d = WorkerSettings()
    p = argparse.ArgumentParser(
        prog="kvflow worker",
        description="Serve a Llama-family model over gRPC with kvflow's torch engine.",
    )
    p.add_argument(
        "--model",
        help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct); with "
        "--task embed an embedding model (default and only: wordllama-l2-supercat)",
    )
    p.add_argument(
        "--task",
        choices=("generate", "embed"),
        default=d.task,
        help="generate text (the engine), or embed: serve /v1/embeddings (docs/engine.md)",
    )
    p.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=d.max_embedding_inputs,
        help="--task embed: inputs per request; more is refused (400)",
    )
    p.add_argument(
        "--max-embedding-input-tokens",
        type=int,
        default=d.max_embedding_input_tokens,
        help="--task embed: tokens per input; a longer one is refused (400)",
    )
    p.add_argument("--served-model-name", help="name clients use (default: the model's name)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="HTTP port for /metrics, /health, /ready",
    )
    p.add_argument(
        "--role",
        type=_role,
        default=d.role,
        metavar="{" + ",".join(ROLE_WORDS) + "}",
        help="colocated: prefill and decode here (the old word `both` still works)",
    )
    p.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d.dtype,
        help="auto: a bfloat16 checkpoint runs in bfloat16 where the device computes it "
        "natively (GPUs from A100 on, CPUs with AVX512-BF16 or AMX); a GGUF, a float32 "
        "checkpoint or another device runs in float32",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=d.quantization,
        help="auto: a GGUF's quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
        "Q6_K) stay quantized and are multiplied by torch's int4 kernels, other types are "
        "refused by name; none: every weight widened to --dtype at load; fp8: a float "
        "checkpoint's attention and MLP weights quantized to FP8 (e4m3, a scale per row) as "
        "they load, for GPUs with FP8 tensor cores (L4, H100, H200)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many devices (cuda:0..N-1 from --device on, or CPU "
        "processes sharing the cores): heads, MLP and vocabulary divide among the ranks, "
        "which this worker spawns and leads; one worker to the router",
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step (bounds prefill chunks)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="requests running at once"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests that may wait for a slot; past it a new one is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after (the router tries another worker or answers 503)",
    )
    p.add_argument(
        "--max-queue-time-s",
        type=float,
        help="also refuse a request whose estimated wait (requests ahead / admissions per "
        "second) is longer than this (default: no bound on time)",
    )
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="memory for the KV cache (default: 1 GiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves)",
    )
    p.add_argument(
        "--num-kv-blocks", type=int, help="KV blocks to allocate (overrides --kv-cache-gib)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="on CUDA, the fraction of the device's memory this worker uses: weights, a "
        "measured peak forward, CUDA graphs, and the KV cache in what is left "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION}); --kv-cache-gib or --num-kv-blocks "
        "size the cache instead",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="auto: the model's dtype; int8 or fp8 (e4m3): one byte per value and a float16 "
        "scale per token and KV head, 1.94x the tokens of a bf16 cache (3.9x float32's); "
        "every worker of a disaggregated pool must use the same",
    )
    p.add_argument(
        "--decode-workspace-gib",
        type=float,
        help="memory for dense copies of the decoding sequences' K/V, so decode attention "
        "copies no blocks each step (default: as much as --kv-cache-gib on CPU, 0 on CUDA; "
        "0 turns it off)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay decode steps from CUDA graphs, one per power-of-two batch and context "
        "bucket, captured on first use (CUDA devices only; not yet measured on a GPU: "
        "docs/engine.md)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="no model: the real scheduler and KV accounting with a timing model",
    )
    p.add_argument(
        "--sim-profile",
        help="with --simulate: step timing and KV geometry of a GPU and model, by name "
        "(h100-llama3-8b, h200-llama3-8b, h100x4-llama3-70b, h200x2-llama3-70b) or a "
        "file from `kvflow profile`; the KV block count is the profile's unless "
        "--num-kv-blocks is given (instead of the --sim-*-ms flags)",
    )
    p.add_argument("--sim-base-step-ms", type=float, default=d.sim_base_step_ms)
    p.add_argument("--sim-per-token-ms", type=float, default=d.sim_per_token_ms)
    p.add_argument("--sim-per-seq-ms", type=float, default=d.sim_per_seq_ms)
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=d.drain_timeout_s,
        help="on SIGTERM, how long to let running requests finish",
    )
    p.add_argument(
        "--engine-stall-timeout-s",
        type=float,
        default=d.engine_stall_timeout_s,
        help="/health (and gRPC Health) fail when the engine thread has stopped or spent "
        "longer than this in one step, so the kubelet restarts a wedged worker",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded sampling")
    p.add_argument(
        "--kv-transport",
        choices=KV_TRANSPORT_CHOICES,
        default=d.kv_transport,
        help="how KV blocks move between prefill and decode workers (auto: nccl on CUDA, "
        "tcp on CPU); every worker of a pool must use the same",
    )
    p.add_argument(
        "--kv-port",
        type=int,
        default=d.kv_port,
        help="port of the KV receiver / rendezvous store (0: any free port)",
    )
    p.add_argument(
        "--advertise-host",
        help="address other workers reach this one at for KV (default: --host, or this "
        "machine's address when --host is 0.0.0.0; in a pod, its IP)",
    )
    p.add_argument(
        "--max-kv-transfer-timeout-s",
        type=float,
        default=d.max_kv_transfer_timeout_s,
        help="the longest a KV transfer may take, whatever the router asks",
    )
    p.add_argument(
        "--kv-peer-allow",
        metavar="CIDRS",
        default=d.kv_peer_allow,
        help="networks this worker sends KV to, comma-separated CIDRs or addresses, e.g. "
        "the pod network 10.244.0.0/16: a reservation naming an endpoint elsewhere is "
        "refused before any connection (default: any endpoint)",
    )
    p.add_argument("--tls-cert-file", metavar="PEM",
                   help="serve gRPC over TLS with this certificate (chain), PEM")  # fmt: skip
    p.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key, PEM")
    p.add_argument(
        "--tls-ca-file",
        metavar="PEM",
        help="require callers to present a certificate this CA signed (mutual TLS)",
    )
    p.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=d.grammar_cache_mib,
        help="memory for compiled structured-output formats (JSON schemas, regexes, "
        "grammars), least recently used evicted first; each counts an estimate of its "
        "compiled size (a typical tool's schema ~60-100 KiB)",
    )
    p.add_argument(
        "--kv-tls",
        choices=KV_TLS_MODES,
        default="auto",
        help="mutual TLS on the TCP KV port from the --tls-* files (auto: when "
        "--tls-ca-file is given; off: KV plaintext, for a trusted network where TLS's cost "
        "on KV throughput matters more; the worker token still proves both ends)",
    )
    p.add_argument(
        "--kv-tls-server-name",
        metavar="NAME",
        help="the name KV receivers' certificates carry, e.g. <pool>-workers.<ns>.svc "
        "(default: the address dialled)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry spans over OTLP/gRPC here, e.g. http://collector:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else none)",
    )
    p.add_argument(
        "--otlp-traces-sample-ratio",
        type=float,
        metavar="R",
        help="ratio of the parent-based sampler, 0-1 (default: $OTEL_TRACES_SAMPLER_ARG, "
        "else 1); only calls with a trace context are traced, and their decision holds",
    )
    a = p.parse_args(list(argv))
    try:
        traces = tracing_config(a.otlp_traces_endpoint, a.otlp_traces_sample_ratio)
    except ValueError as exc:
        p.error(str(exc))
    if a.cuda_graphs and not a.device.startswith("cuda"):
        p.error(f"--cuda-graphs needs a CUDA device (--device cuda), not {a.device!r}")
    if a.quantization == "fp8" and not a.device.startswith("cuda"):
        p.error(
            f"--quantization fp8 needs a CUDA GPU with FP8 tensor cores (--device cuda), not "
            f"{a.device!r}: on a CPU FP8 GEMMs run slower than bf16 ones; serve a GGUF (Q4/Q8, "
            "kept quantized) or a bf16 checkpoint instead"
        )
    if a.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size {a.tensor_parallel_size}: it must be at least 1")
    if a.tensor_parallel_size > 1:
        if a.simulate:
            p.error("--simulate runs no model to split: drop --tensor-parallel-size")
        if a.cuda_graphs:
            p.error(
                "--cuda-graphs does not capture tensor-parallel steps yet: drop one of "
                "--cuda-graphs and --tensor-parallel-size"
            )
    problem = _memory_flags_problem(a)
    if problem:
        p.error(problem)
    try:
        PeerAllowList.parse(a.kv_peer_allow)
    except ValueError as exc:
        p.error(str(exc))
    if a.task == "embed" and (a.simulate or a.tensor_parallel_size > 1 or a.role != Role.COLOCATED):
        p.error("--task embed runs no engine: drop --simulate, --tensor-parallel-size and --role")
    if a.max_embedding_inputs < 1 or a.max_embedding_input_tokens < 1:
        p.error("--max-embedding-inputs and --max-embedding-input-tokens must be at least 1")
    if a.grammar_cache_mib < 1:
        p.error(f"--grammar-cache-mib {a.grammar_cache_mib} must be at least 1")
    tls = TlsFiles(a.tls_cert_file, a.tls_key_file, a.tls_ca_file, a.kv_tls, a.kv_tls_server_name)
    if tls.problem():
        p.error(tls.problem())
    if a.cuda_graphs and a.decode_workspace_gib:
        p.error(
            "--cuda-graphs replays decode steps without the decode workspace: drop "
            "--decode-workspace-gib or --cuda-graphs"
        )
    settings = WorkerSettings(
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
    transport = settings.resolved_kv_transport()
    if a.kv_tls == "on" and transport != "tcp":
        p.error(f"--kv-tls on covers the tcp KV transport, not {transport} (--kv-transport tcp)")
    return settings


def _memory_flags_problem(a: argparse.Namespace) -> str:
    """What is wrong with the memory and KV-dtype flags together, or ""."""
    utilization = a.gpu_memory_utilization
    if utilization is not None and not 0.0 < utilization <= 1.0:
        return f"--gpu-memory-utilization {utilization:g} must lie in (0, 1]"
    if utilization is not None and (a.simulate or not a.device.startswith("cuda")):
        return (
            "--gpu-memory-utilization sizes a CUDA device's memory; on the CPU (or with "
            "--simulate) size the KV cache with --kv-cache-gib or --num-kv-blocks"
        )
    if a.kv_cache_gib is not None and a.kv_cache_gib <= 0:
        return f"--kv-cache-gib {a.kv_cache_gib:g} must be positive"
    if a.kv_cache_dtype != "auto" and a.simulate:
        return (
            "--simulate models the KV bytes of its profile (or SmolLM2's float32): drop "
            "--kv-cache-dtype, or give the block count with --num-kv-blocks"
        )
    if a.kv_cache_dtype == "fp8":
        # Only here does the command line import torch: a worker that asks for fp8 runs it.
        import torch

        from kvflow.engine_worker.model.kv_quant import (
            KvCacheDtypeError,
            check_device_supports,
            kv_cache_dtype,
        )

        try:
            check_device_supports(kv_cache_dtype("fp8", torch.float32), a.device)
        except KvCacheDtypeError as exc:
            return str(exc)
    return ""


def _role(word: str) -> Role:
    try:
        return Role.parse(word)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid role {word!r}: choose one of {', '.join(ROLE_WORDS)}"
        ) from None
