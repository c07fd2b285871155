"""The InferencePool API, version v1alpha1: the one typed source of the CRD. This module holds
the pool's spec and identity; its parts live beside it: the model in ``v1alpha1_model``, the
engine and roles in ``v1alpha1_workers``, the gateway in ``v1alpha1_router``, the planner's
spec types in ``v1alpha1_planner``, admission's in ``v1alpha1_admission``, the status types
in ``v1alpha1_status``.

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

from kvflow.operator.api.schema import CelRule, cel, field
from kvflow.operator.api.v1alpha1_embedding import EMBED_RULES, EmbeddingSpec, Task
from kvflow.operator.api.v1alpha1_model import ModelSpec
from kvflow.operator.api.v1alpha1_observability import ObservabilitySpec
from kvflow.operator.api.v1alpha1_planner import AutoscalingSpec, SloSpec
from kvflow.operator.api.v1alpha1_router import ROUTER_AUTH_RULES, RouterSpec, SecretKeyRef
from kvflow.operator.api.v1alpha1_workers import EngineSpec, RoleSpec

GROUP = "kvflow.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ("kvpool",)  # not "ipool": the Gateway API extension's InferencePool may own it

Mode = Literal["colocated", "disaggregated"]
KvTransport = Literal["auto", "nccl", "gloo", "tcp"]


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
    *EMBED_RULES,
)
@dataclass(frozen=True)
class InferencePoolSpec:
    """A model served by a pool of engine workers behind one OpenAI-compatible gateway."""

    model: ModelSpec = field("The model to serve.")
    engine: EngineSpec = field("Worker image and engine settings.", EngineSpec())
    task: Task = field(
        """generate: the workers generate text (completions, chat). embed: an embedding
        pool, whose workers serve /v1/embeddings with the image's built-in
        wordllama-l2-supercat (`kvflow worker --task embed`); a gateway's semantic cache
        embeds prompts with one.""",
        "generate",
    )
    embedding: EmbeddingSpec = field(
        "Request limits of an embedding pool (task embed).", EmbeddingSpec()
    )
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
