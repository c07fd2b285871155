"""The `kvflow worker` settings record: every knob of one worker, typed, with its default."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine_worker.tls import TlsFiles
from kvflow.proto.block_hash import DEFAULT_BLOCK_SIZE
from kvflow.proto.otel import TracingConfig
from kvflow.proto.roles import Role

# A CPU worker's KV cache without --kv-cache-gib; a CUDA one is sized by utilization.
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# vLLM's default: the fraction of a GPU's memory a worker takes (weights, activations, cache).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


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
    # queueing; the command line's default is DEFAULT_MAX_WAITING_REQUESTS (scheduler_flags.py).
    max_waiting_requests: int | None = None
    max_queue_time_s: float | None = None  # also refuse past this estimated wait
    max_model_len: int | None = None  # None: the model's own limit
    # None: DEFAULT_CPU_KV_CACHE_GIB on the CPU; on CUDA what gpu_memory_utilization leaves
    # once the weights and a peak forward are measured (memory/measure.py).
    kv_cache_gib: float | None = None
    num_kv_blocks: int | None = None  # overrides kv_cache_gib
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES (cache_flags.py)
    # Dense copies of decoding sequences' K/V so decode attention gathers nothing
    # (model/decode_workspace.py). None: kv_cache_gib on CPU, 0 (off) on CUDA, where the
    # memory is better spent on the cache.
    decode_workspace_gib: float | None = None
    # Decodes read the paged cache in place through a kernel where one runs (the CPU's,
    # model/cpu_paged.py; Triton's on CUDA); False: they read the
    # workspace or gather their blocks.
    paged_attention: bool = True
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
