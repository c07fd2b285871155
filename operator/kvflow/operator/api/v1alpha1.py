"""The InferencePool API, version v1alpha1: the one typed source of the CRD (the planner's
spec types are in ``v1alpha1_planner``, admission's in ``v1alpha1_admission``, the status
types in ``v1alpha1_status``).

`tools/k8s/gen_crds.py` turns these records into `crds/` (and the chart's copy); the operator
reads pools into them with `schema.from_json`. Descriptions are what `kubectl explain`
prints, so they are written for the platform engineer who fills in a pool.
Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, JsonObject, Quantity, cel, field
from kvflow.operator.api.v1alpha1_admission import AdmissionSpec
from kvflow.operator.api.v1alpha1_observability import ObservabilitySpec
from kvflow.operator.api.v1alpha1_planner import AutoscalingSpec, SloSpec
from kvflow.operator.api.v1alpha1_response_cache import ResponseCacheSpec

GROUP = "kvflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("kvpool",)  # not "ipool": the Gateway API extension's InferencePool may own it

Dtype = Literal["auto", "float32", "bfloat16"]
KvCacheDtype = Literal["auto", "int8", "fp8"]
Mode = Literal["colocated", "disaggregated"]
KvTransport = Literal["auto", "nccl", "gloo", "tcp"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]

# A served model name travels in every OpenAI request body; keep it printable and short.
_SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


@dataclass(frozen=True)
class PvcSource:
    """A PersistentVolumeClaim in the pool's namespace that holds the model."""

    claim_name: str = field("Name of the claim.", min_length=1, max_length=253)
    read_only: bool = field("Mount the claim read-only (workers never write).", True)


@dataclass(frozen=True)
class HostPathSource:
    """A folder on every node that holds the model (single-node and kind clusters)."""

    path: str = field("Absolute folder on the node.", pattern="^/", max_length=4096)


@cel(
    CelRule(
        "has(self.persistentVolumeClaim) != has(self.hostPath)",
        "model.volume needs exactly one of persistentVolumeClaim or hostPath",
    )
)
@dataclass(frozen=True)
class ModelVolume:
    """Where the model files live; mounted read-only at /models in workers and routers."""

    persistent_volume_claim: PvcSource | None = field("A claim holding the model.", None)
    host_path: HostPathSource | None = field("A node folder holding the model.", None)


# USD per million tokens as a decimal string: exact where a float is not (the router holds
# money in whole pico-dollars, so at most 6 decimals).
_USD_PER_MILLION_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?$"


@dataclass(frozen=True)
class PriceSpec:
    """What the model's tokens cost, for tenants' spend and budgets in money (docs/router.md,
    "Tenants"): USD per million tokens, as decimal strings such as "0.15"."""

    input_usd_per_million_tokens: str = field(
        "Prompt tokens not served from a prefix cache.", "0", pattern=_USD_PER_MILLION_PATTERN
    )
    cached_input_usd_per_million_tokens: str | None = field(
        "Prompt tokens served from a worker's prefix cache; unset: the input price.",
        None,
        pattern=_USD_PER_MILLION_PATTERN,
    )
    output_usd_per_million_tokens: str = field(
        "Generated tokens.", "0", pattern=_USD_PER_MILLION_PATTERN
    )


@cel(
    CelRule(
        "!has(self.volume) || (self.path != '' && !self.path.startsWith('/'))",
        "model.path must be a path relative to model.volume when a volume is set",
        ".path",
    )
)
@dataclass(frozen=True)
class ModelSpec:
    """The model every worker of the pool serves, and the name tenants ask for."""

    served_name: str = field(
        "The model name tenants send in OpenAI requests (and /v1/models lists).",
        min_length=1,
        max_length=128,
        pattern=_SERVED_NAME_PATTERN,
    )
    path: str = field(
        """A Hugging Face folder (config.json, *.safetensors, tokenizer) or a .gguf file.
        Relative to the volume's mount when `volume` is set, else an absolute path inside
        the image. Empty: the worker's built-in SmolLM2-135M-Instruct.""",
        "",
        max_length=4096,
    )
    volume: ModelVolume | None = field("The volume that holds `path`.", None)
    dtype: Dtype = field(
        """Weights and activations dtype. auto: a bfloat16 checkpoint (config.json's
        torch_dtype) runs in bfloat16 where the node computes it natively (GPUs from A100
        on, CPUs with AVX512-BF16 or AMX); a GGUF, the built-in model among them, a float32
        checkpoint or other hardware runs in float32. Set it when a disaggregated pool's
        prefill and decode pods may land on different hardware: their KV must share one
        dtype.""",
        "auto",
    )
    max_model_len: int = field(
        "Longest sequence (prompt plus output) in tokens; longer requests are refused.",
        4096,
        minimum=16,
        maximum=1048576,
    )
    prices: PriceSpec | None = field(
        "The model's prices, charged to tenants' spend (unset: free).", None
    )


@cel(
    CelRule(
        "self.maxNumBatchedTokens >= self.blockSize",
        "engine.maxNumBatchedTokens must be at least engine.blockSize",
    )
)
@dataclass(frozen=True)
class EngineSpec:
    """The worker image and the engine's scheduling and memory settings."""

    image: str = field("Worker image; empty means the operator's default.", "")
    image_pull_policy: PullPolicy = field("Pull policy of the worker image.", "IfNotPresent")
    block_size: int = field(
        "Tokens per KV block (and per prefix-cache hash); the router hashes alike.",
        16,
        minimum=1,
        maximum=256,
    )
    max_num_batched_tokens: int = field(
        "Token budget of one engine step (prefill chunks plus decodes).",
        2048,
        minimum=1,
        maximum=1048576,
    )
    max_num_seqs: int = field("Most sequences in one batch.", 64, minimum=1, maximum=4096)
    kv_cache_gib: float | None = field(
        """Memory given to the paged KV cache per worker, in GiB. Unset: 1 GiB on CPU
        pods; on GPU pods what gpuMemoryUtilization leaves once the weights and a peak
        forward are measured.""",
        None,
        json_name="kvCacheGiB",
        minimum=0,
        exclusive_minimum=True,
        maximum=4096,
    )
    gpu_memory_utilization: float = field(
        """On GPU pods, the fraction of each GPU's memory a worker uses: its weights, a
        measured peak forward, CUDA graphs, and the KV cache in what is left (unless
        kvCacheGiB sizes the cache). Ignored on CPU pods.""",
        0.9,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    kv_cache_dtype: KvCacheDtype = field(
        """How the KV cache stores keys and values. auto: the model's dtype. int8 or fp8
        (e4m3): one byte per value and a float16 scale per token and KV head, 1.94x the
        tokens of a bfloat16 cache in the same memory (3.9x a float32 one). Prefill and
        decode workers of a pool share it.""",
        "auto",
    )
    simulate: bool = field(
        "Run the scheduler and block accounting with a timing model instead of the model "
        "(dozens of workers on one CPU; for tests and demos).",
        False,
    )
    drain_timeout_seconds: int = field(
        """How long a stopping worker may finish in-flight requests after SIGTERM before it
        is killed (the pod's terminationGracePeriodSeconds).""",
        120,
        minimum=0,
        maximum=3600,
    )
    extra_args: list[str] = field(
        "Extra `kvflow worker` flags, appended as given.", [], max_items=64
    )


@dataclass(frozen=True)
class Resources:
    """Compute resources of one container (as in a Pod's resources)."""

    requests: dict[str, Quantity] = field("Requested resources, e.g. cpu: 2, memory: 8Gi.", {})
    limits: dict[str, Quantity] = field("Resource limits, e.g. memory: 8Gi.", {})


@cel(
    CelRule(
        "self.minReplicas <= self.maxReplicas",
        "minReplicas must not exceed maxReplicas",
    ),
    CelRule(
        "self.minReplicas <= self.replicas && self.replicas <= self.maxReplicas",
        "replicas must lie within [minReplicas, maxReplicas]",
        ".replicas",
    ),
)
@dataclass(frozen=True)
class RoleSpec:
    """One role's workers: how many, their accelerators and where they run."""

    replicas: int = field(
        """Worker pods of this role. With autoscaling enabled it is where the planner
        starts; the planner's decisions then live in status.planner.roles.""",
        1,
        minimum=0,
        maximum=1024,
    )
    min_replicas: int = field("Autoscaling lower bound.", 0, minimum=0, maximum=1024)
    max_replicas: int = field("Autoscaling upper bound.", 8, minimum=0, maximum=1024)
    external_autoscaler: bool = field(
        """Hand this role's replicas to an autoscaler outside kvflow (a
        HorizontalPodAutoscaler, KEDA, or `kubectl scale`) that targets its Deployment,
        <pool>-<role>. The operator creates the Deployment with `replicas` and never
        writes its replica count again; the planner leaves the role alone.""",
        False,
    )
    gpus_per_pod: int = field(
        """nvidia.com/gpu requested per pod. Above zero the worker runs with
        --device cuda (and gets a memory-backed /dev/shm for NCCL); above one it splits the
        model over the pod's GPUs (--tensor-parallel-size gpusPerPod), so the model's
        attention and KV heads, MLP width and vocabulary must divide by it, or the worker
        refuses to start and says which. Prefill and decode may split differently: KV moves
        between them as whole blocks.""",
        0,
        minimum=0,
        maximum=16,
    )
    resources: Resources = field("CPU and memory of the worker container.", Resources())
    node_selector: dict[str, str] = field("Node labels the pods require.", {})
    tolerations: list[JsonObject] = field("Pod tolerations (core/v1 Toleration).", [])
    affinity: JsonObject | None = field("Pod affinity (core/v1 Affinity).", None)


@dataclass(frozen=True)
class ScorerWeights:
    """The router's scorer weights, each field named as the router's scorer (in snake_case:
    docs/router.md, "Routing"). All unset: the router's default, which scores a worker by
    the seconds the request would cost there (timeCost 1, session 0.01). Any of
    prefixCache, queueDepth or kvCacheUsage set, and timeCost not: the block policy, a
    weighted sum of these scorers, its unset weights at the router's block defaults
    (prefixCache 1, queueDepth 1, session 8). Otherwise the time-based default, with the
    weights set here over its own."""

    prefix_cache: float | None = field(
        "Weight of the share of the prompt's blocks a worker already caches.", None, minimum=0
    )
    queue_depth: float | None = field("Weight of the (negated) queue length.", None, minimum=0)
    kv_cache_usage: float | None = field("Weight of the (negated) KV-cache fill.", None, minimum=0)
    time_cost: float | None = field(
        """Weight of the (negated) seconds the request would cost on a worker: the
        router's default scorer, at weight 1. 0 with a block weight set leaves the block
        policy as it is.""",
        None,
        minimum=0,
    )
    session: float | None = field(
        """Weight of returning to the worker that served the session last (0.01 by
        default, in seconds; 8 in the block policy, in blocks).""",
        None,
        minimum=0,
    )


@dataclass(frozen=True)
class WorkerTlsSpec:
    """Worker gRPC and the TCP KV port over mutual TLS, from a Secret laid out as cert-manager
    issues one."""

    secret_name: str = field(
        """A Secret in the pool's namespace with tls.crt, tls.key and ca.crt (a cert-manager
        Certificate's). Its certificate must name <pool>-workers.<namespace>.svc and allow
        server and client auth: workers serve with it and require callers to present one
        the same CA signed; the pool's routers present it, and prefill workers present it
        to the decode workers they send KV to.""",
        min_length=1,
        max_length=253,
    )


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the pool's namespace."""

    name: str = field("Secret name.", min_length=1, max_length=253)
    key: str = field("Key inside the Secret.", min_length=1, max_length=253)


@cel(
    CelRule(
        "!(self.url != '' && has(self.urlSecret))",
        "router.redis takes url or urlSecret, not both",
    )
)
@dataclass(frozen=True)
class RedisSpec:
    """The Redis that router replicas share (tenant keys, quotas, rate limits)."""

    url: str = field(
        "redis:// URL; empty with no urlSecret: each router keeps its own in-memory state.",
        "",
        pattern="^(rediss?://.*)?$",
    )
    url_secret: SecretKeyRef | None = field("A Secret key holding the URL (password).", None)


@dataclass(frozen=True)
class DisaggregationSpec:
    """When the router hands a prompt to a prefill worker (mode disaggregated only).

    Each request is decided on its own: a prompt goes to a prefill worker only when the
    part the chosen decode worker does not cache is long enough and the prefill workers are
    not backed up; otherwise the decode worker prefills it itself. Unset fields keep the
    router's own defaults (`docs/router.md`).
    """

    min_remote_prefill_tokens: int | None = field(
        """Prefill on a prefill worker only when the decode worker lacks at least this many
        prompt tokens (short prompts cost more to ship than to compute).""",
        None,
        minimum=0,
        maximum=1048576,
    )
    max_prefill_queue_depth: int | None = field(
        "Skip prefill workers with more requests than this waiting; decode prefills instead.",
        None,
        minimum=0,
        maximum=65536,
    )
    transfer_timeout_seconds: float | None = field(
        """How long one KV transfer may take; past it the reserved blocks are freed on both
        workers and the request is retried or prefilled by the decode worker.""",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=600,
    )


# Secure by default: a gateway without tenants lets every caller in as an administrator with
# no quota, so it takes a named opt-in, and never on a Service reachable from outside. On
# the spec that holds `router` (a pool's or a gateway's), not on RouterSpec: the API server
# checks a field's default against its own rules, and the default router has no tenants.
ROUTER_AUTH_RULES = (
    CelRule(
        "has(self.router.tenantsSecret) || self.router.allowUnauthenticated",
        "router.tenantsSecret is required (the gateway's tenants and API keys); set "
        "router.allowUnauthenticated: true to serve without authentication",
        ".router",
    ),
    CelRule(
        "!self.router.allowUnauthenticated || self.router.serviceType == 'ClusterIP'",
        "router.allowUnauthenticated needs serviceType ClusterIP: an unauthenticated "
        "gateway is never exposed outside the cluster",
        ".router",
    ),
)


@dataclass(frozen=True)
class RouterSpec:
    """The OpenAI-compatible gateway in front of the workers."""

    replicas: int = field("Router pods (active-active).", 1, minimum=1, maximum=64)
    image: str = field("Router image; empty means the operator's default.", "")
    image_pull_policy: PullPolicy = field("Pull policy of the router image.", "IfNotPresent")
    resources: Resources = field("CPU and memory of the router container.", Resources())
    service_type: ServiceType = field("Type of the gateway Service.", "ClusterIP")
    port: int = field("Port of the gateway Service.", 80, minimum=1, maximum=65535)
    scorer_weights: ScorerWeights = field("Routing weights.", ScorerWeights())
    redis: RedisSpec = field("Shared state for router replicas.", RedisSpec())
    tenants_secret: SecretKeyRef | None = field(
        """A Secret key holding the gateway's tenants: the `tenants:` list of docs/router.md
        (names, API key digests, models, quotas, priorities). Mounted into the router pods
        and re-read when the Secret changes, without a restart. Required unless
        allowUnauthenticated is true.""",
        None,
    )
    allow_unauthenticated: bool = field(
        """Serve without tenants: every caller is an administrator with no quota, all share
        one prefix cache and may ask for route explanations. Only with serviceType
        ClusterIP; for demos and tests. Ignored when tenantsSecret is set.""",
        False,
    )
    tenant_key_secret: SecretKeyRef | None = field(
        """A Secret key holding the server-side secret that the tenants'
        api_key_hmac_sha256 digests are made with (KVFLOW_TENANT_KEY_SECRET).""",
        None,
    )
    disaggregation: DisaggregationSpec = field(
        "Per-request disaggregation policy (used in mode disaggregated).", DisaggregationSpec()
    )
    admission: AdmissionSpec = field(
        "Load shedding (429/503 with Retry-After) from the workers' queues.", AdmissionSpec()
    )
    response_cache: ResponseCacheSpec = field(
        "Answers of repeated deterministic requests (the router's --response-cache).",
        ResponseCacheSpec(),
    )
    node_selector: dict[str, str] = field("Node labels the router pods require.", {})
    tolerations: list[JsonObject] = field("Router pod tolerations.", [])


@cel(
    CelRule(
        "self.mode == 'colocated' || (has(self.prefill) && has(self.decode))",
        "mode disaggregated needs both prefill and decode",
    ),
    CelRule(
        "self.kvTransport != 'nccl' || self.mode == 'colocated' || "
        "(has(self.prefill) && self.prefill.gpusPerPod > 0 && "
        "has(self.decode) && self.decode.gpusPerPod > 0)",
        "kvTransport nccl needs gpusPerPod > 0 on both prefill and decode",
        ".kvTransport",
    ),
    CelRule(
        "self.kvTransport != 'auto' || self.mode == 'colocated' || "
        "!has(self.prefill) || !has(self.decode) || "
        "(self.prefill.gpusPerPod > 0) == (self.decode.gpusPerPod > 0)",
        "kvTransport auto needs prefill and decode both on GPUs or both on CPUs "
        "(it picks nccl on GPUs, tcp on CPUs)",
        ".kvTransport",
    ),
    *ROUTER_AUTH_RULES,
)
@dataclass(frozen=True)
class InferencePoolSpec:
    """A model served by a pool of engine workers behind one OpenAI-compatible gateway."""

    model: ModelSpec = field("The model to serve.")
    engine: EngineSpec = field("Worker image and engine settings.", EngineSpec())
    mode: Mode = field(
        """colocated: every worker prefills and decodes (role colocated). disaggregated:
        separate prefill and decode workers; the router sends a prompt to a prefill worker
        when the decode worker lacks enough of it (router.disaggregation), the prompt's KV
        blocks move to the decode worker, which generates; other prompts are prefilled by
        the decode worker itself.""",
        "colocated",
    )
    colocated: RoleSpec = field("Workers that prefill and decode (mode colocated).", RoleSpec())
    prefill: RoleSpec | None = field("Prefill workers (mode disaggregated).", None)
    decode: RoleSpec | None = field("Decode workers (mode disaggregated).", None)
    kv_transport: KvTransport = field(
        """How KV blocks move from prefill to decode workers in mode disaggregated (the
        worker's --kv-transport). auto: nccl between GPU workers, tcp between CPU workers.
        nccl: GPU to GPU (needs gpusPerPod on both roles; kvflow's own tests have not yet
        run it on GPUs). gloo: torch.distributed over TCP. tcp: a plain TCP stream.""",
        "auto",
    )
    router: RouterSpec = field("The gateway.", RouterSpec())
    slo: SloSpec = field("Latency targets.", SloSpec())
    autoscaling: AutoscalingSpec = field("The SLO planner.", AutoscalingSpec())
    observability: ObservabilitySpec = field(
        "OpenTelemetry traces (off unless an OTLP endpoint is set).", ObservabilitySpec()
    )
    worker_tls: WorkerTlsSpec | None = field(
        """Worker gRPC over mutual TLS (unset: plaintext inside the cluster, the worker token
        still required). The KV port between workers is not covered: its payload is
        authenticated under the worker token but not encrypted.""",
        None,
    )
    worker_token_secret: SecretKeyRef | None = field(
        """A Secret key in the pool's namespace holding a token: the pool's workers refuse
        gRPC calls that do not present it and its routers present it (KVFLOW_WORKER_TOKEN).
        Unset: the operator creates a Secret <pool>-worker-token (key `token`, random,
        owned by the pool, never rotated) and uses that.""",
        None,
    )
