"""An embedding pool in the InferencePool spec, version v1alpha1: workers that run
`kvflow worker --task embed` and serve /v1/embeddings (docs/engine.md, "Embeddings").

Split from ``v1alpha1`` (whose pool spec holds `task` and `embedding`) to keep each file one
concept. The worker image ships one embedding model, wordllama-l2-supercat (the worker's
default and only one), so the rules below refuse what such a worker cannot run: a model
path or volume, a simulated engine, disaggregation, tensor parallelism and the SLO planner
(it scales by generation metrics an embedder does not have). Pure: imports neither kopf nor
kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, field

Task = Literal["generate", "embed"]

# The worker's defaults (kvflow.engine_worker.settings.WorkerSettings).
WORKER_MAX_INPUTS = 2048
WORKER_MAX_INPUT_TOKENS = 8192

_EMBED = "self.task != 'embed' || "
# On the pool spec: each rule names what an embedding worker cannot do.
EMBED_RULES = (
    CelRule(
        _EMBED + "(self.model.path == '' && !has(self.model.volume))",
        "task embed serves the worker image's built-in wordllama-l2-supercat: leave "
        "model.path and model.volume empty",
        ".model",
    ),
    CelRule(
        _EMBED + "self.mode == 'colocated'",
        "task embed runs no engine to split: mode must be colocated",
        ".mode",
    ),
    CelRule(
        _EMBED + "!self.engine.simulate",
        "task embed runs no engine to simulate: engine.simulate must be false",
        ".engine.simulate",
    ),
    CelRule(
        _EMBED + "self.colocated.gpusPerPod <= 1",
        "task embed runs on one device: colocated.gpusPerPod must be 0 or 1",
        ".colocated.gpusPerPod",
    ),
    CelRule(
        _EMBED + "!self.autoscaling.enabled",
        "task embed: the SLO planner scales generating pools only; scale an embedding "
        "pool with colocated.replicas or colocated.externalAutoscaler",
        ".autoscaling.enabled",
    ),
)


@dataclass(frozen=True)
class EmbeddingSpec:
    """Request limits of an embedding pool's workers (task embed); past one a request is
    a 400 naming it."""

    max_inputs_per_request: int = field(
        "Inputs in one /v1/embeddings request.",
        WORKER_MAX_INPUTS,
        minimum=1,
        maximum=1_000_000,
    )
    max_input_tokens: int = field(
        "Tokens of one input.", WORKER_MAX_INPUT_TOKENS, minimum=1, maximum=1_048_576
    )
