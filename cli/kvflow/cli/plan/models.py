"""What the planner needs of a model: parameter counts and the KV cache's shape.

A ``ModelSpec`` comes from a preset, from flags (parameters plus the KV shape), or from a
model folder or GGUF file (``model_files.py``). Full shapes reuse the simulator's
``ModelShape`` arithmetic; only tied embeddings (one matrix for the embedding and the LM
head, as in SmolLM2 and Llama 3.2) are subtracted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.cli.plan.errors import PlanError
from kvflow.engine_worker.sim.hardware import LLAMA3_8B, LLAMA3_70B, ModelShape
from kvflow.proto.cli_args import is_positive

#: Bytes a stored value takes. int4 is the payload alone: the group scales of GPTQ/AWQ add
#: about 3 % (a 16-bit scale per 128 weights is 0.125 bits on 4).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_params: int  # what the weights hold in memory
    num_matmul_params: int  # what each token multiplies by (not the embedding, a lookup)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int | None  # None: not known, not checked
    # What the source stores per parameter (a GGUF's quantization, a quantized config.json);
    # None: not known, the plan's --weight-dtype (default bf16) decides.
    stored_bytes_per_param: float | None
    source: str  # "preset", "flags", a path: for the report

    def kv_bytes_per_token(self, kv_bytes_per_value: float) -> float:
        """Keys and values of one token in every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes_per_value

    @property
    def matmul_flops_per_token(self) -> int:
        """A multiply and an add per weight a token passes through."""
        return 2 * self.num_matmul_params

    def attention_flops_per_token(self, context_tokens: float) -> float:
        """QK^T and PV against ``context_tokens`` keys: 2 x 2 x heads x head_dim each, per layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * context_tokens


def from_shape(
    shape: ModelShape,
    *,
    tied_embeddings: bool,
    max_context_tokens: int | None,
    source: str,
    stored_bytes_per_param: float | None = None,
) -> ModelSpec:
    embed = shape.vocab_size * shape.hidden_size
    return ModelSpec(
        name=shape.name,
        # ModelShape counts an untied LM head; a tied one shares the embedding's matrix.
        num_params=shape.num_params - (embed if tied_embeddings else 0),
        # Tied or not, every token multiplies by the LM head's vocab x hidden matrix.
        num_matmul_params=shape.num_matmul_params,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_context_tokens=max_context_tokens,
        stored_bytes_per_param=stored_bytes_per_param,
        source=source,
    )


# HuggingFaceTB/SmolLM2-135M config.json: 134.5 M parameters (tied embeddings) and
# 2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 bytes of KV per token.
SMOLLM2_135M = ModelShape("SmolLM2-135M", 49152, 576, 1536, 30, 9, 3, 64)

# name -> (shape, tied embeddings, trained context). Llama 3 (not 3.1) was trained on 8k.
_PRESETS: dict[str, tuple[ModelShape, bool, int]] = {
    "llama-3-8b": (LLAMA3_8B, False, 8192),
    "llama-3-70b": (LLAMA3_70B, False, 8192),
    "smollm2-135m": (SMOLLM2_135M, True, 8192),
}
# The simulator's spellings (profile names such as h100-llama3-8b) are accepted too.
_ALIASES = {"llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b"}
PRESETS = tuple(_PRESETS)


def preset(name: str) -> ModelSpec | None:
    """The preset called ``name`` (any case), or None."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _PRESETS:
        return None
    shape, tied, context = _PRESETS[key]
    return from_shape(shape, tied_embeddings=tied, max_context_tokens=context, source="preset")


def from_flags(
    *,
    params_b: float,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context_tokens: int | None,
) -> ModelSpec:
    """A model described by its parameter count (billions) and attention shape.

    Without the hidden and vocabulary sizes the embedding cannot be told apart, so every
    parameter is counted as multiplied per token: at most vocab x hidden too many (0.5 B
    of 8 B for Llama 3, 6 %), which errs towards slower steps.
    """
    values = {"--layers": num_layers, "--heads": num_heads, "--kv-heads": num_kv_heads,
              "--head-dim": head_dim}  # fmt: skip
    for flag, value in values.items():
        if value < 1:
            raise PlanError(f"{flag} must be >= 1, got {value}")
    if max_context_tokens is not None and max_context_tokens < 1:
        raise PlanError(f"--max-context must be >= 1 token, got {max_context_tokens}")
    if not is_positive(params_b):
        raise PlanError(f"--params-b must be > 0 (billions of parameters), got {params_b}")
    if num_heads % num_kv_heads:
        raise PlanError(
            f"--kv-heads {num_kv_heads} must divide --heads {num_heads} (each KV head serves "
            "a whole group of query heads)"
        )
    num_params = round(params_b * 1e9)
    return ModelSpec(
        name=f"{params_b:g}B",
        num_params=num_params,
        num_matmul_params=num_params,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_context_tokens=max_context_tokens,
        stored_bytes_per_param=None,
        source="flags",
    )
