"""The InferencePool API's model: what a pool serves, where its files live and what its tokens
cost (part of the v1alpha1 CRD; the pool spec is in ``v1alpha1``)."""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, cel, field

Dtype = Literal["auto", "float32", "bfloat16"]

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
