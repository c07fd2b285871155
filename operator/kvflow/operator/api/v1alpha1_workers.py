"""The InferencePool API's workers: the engine's image and settings, and each role's replicas,
accelerators and placement (part of the v1alpha1 CRD; the pool spec is in ``v1alpha1``)."""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, JsonObject, Quantity, cel, field

KvCacheDtype = Literal["auto", "int8", "fp8"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]


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
