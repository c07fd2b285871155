"""What the engine needs to know about a model, parsed from a Hugging Face ``config.json``.

GGUF metadata is parsed into the same record in ``gguf_file.py``. Only what our Llama-family
decoder implements is accepted; anything else fails here, before a tensor is read, with an
error naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvflow.engine_worker.model.errors import ModelLoadError

#: ``architectures[0]`` values we run, each with the ``model_type`` that implies it.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

RopeType = Literal["linear", "llama3", "freq_factors"]


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are stretched for a longer context than trained on.

    ``linear`` divides every frequency by ``factor``. ``llama3`` divides the low frequencies
    by ``factor``, keeps the high ones and blends in between (Llama 3.1's scheme).
    ``freq_factors`` divides frequency ``i`` by ``freq_factors[i]``: how a GGUF file stores
    Llama 3.1's scheme, precomputed (its ``rope_freqs.weight`` tensor).
    """

    rope_type: RopeType
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0  # 0 only where rope_type ignores it
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape and constants; frozen so it can key caches."""

    name: str  # human name: the folder or file stem
    architecture: str  # one of SUPPORTED_ARCHITECTURES' values
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # Qwen2 always; Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias

    def to_json(self) -> str:
        """A JSON text that ``from_json`` turns back into an equal config."""
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> ModelConfig:
        raw = json.loads(text)
        scaling = raw.pop("rope_scaling")
        if scaling is not None:
            scaling["freq_factors"] = tuple(scaling["freq_factors"])
            scaling = RopeScaling(**scaling)
        raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
        return ModelConfig(rope_scaling=scaling, **raw)


def check_config(config: ModelConfig, source: str) -> ModelConfig:
    """Reject shapes our layers cannot run, naming the field; returns ``config``."""

    def bad(field_name: str, why: str) -> ModelLoadError:
        value = getattr(config, field_name)
        return ModelLoadError(f"{source}: field '{field_name}' = {value!r} {why}")

    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        if getattr(config, name) <= 0:
            raise bad(name, "must be a positive integer")
    if config.num_attention_heads % config.num_key_value_heads:
        raise bad(
            "num_key_value_heads",
            f"must divide num_attention_heads = {config.num_attention_heads} "
            "(grouped-query attention shares each KV head among a whole group)",
        )
    if config.head_dim % 2:
        raise bad("head_dim", "must be even (RoPE rotates pairs of dimensions)")
    if config.rms_norm_eps <= 0 or config.rope_theta <= 0:
        raise bad("rms_norm_eps" if config.rms_norm_eps <= 0 else "rope_theta", "must be > 0")
    scaling = config.rope_scaling
    if scaling is not None:
        if scaling.factor <= 0:
            raise ModelLoadError(f"{source}: rope scaling 'factor' = {scaling.factor} must be > 0")
        if scaling.rope_type == "llama3" and not (
            scaling.original_max_position_embeddings > 0
            and scaling.high_freq_factor > scaling.low_freq_factor
        ):
            raise ModelLoadError(
                f"{source}: llama3 rope scaling needs 'original_max_position_embeddings' > 0 "
                f"and 'high_freq_factor' > 'low_freq_factor', got {scaling}"
            )
        if (
            scaling.rope_type == "freq_factors"
            and len(scaling.freq_factors) != config.head_dim // 2
        ):
            raise ModelLoadError(
                f"{source}: {len(scaling.freq_factors)} RoPE frequency factors for "
                f"head_dim = {config.head_dim}; expected {config.head_dim // 2}"
            )
    return config


def config_from_hf(
    raw: Mapping[str, Any],
    *,
    name: str,
    source: str = "config.json",
    generation_config: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """Parse a Hugging Face ``config.json`` (transformers 4.x or 5.x field names).

    ``generation_config`` (``generation_config.json``, when the folder has one) adds its end
    tokens: Llama 3 instruct models end turns with a token that only it lists.
    """
    fields = _Fields(raw, source)
    architecture = _architecture(raw, source)
    model_type = next(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == architecture)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{source}: field 'hidden_act' = {raw['hidden_act']!r} is not supported; "
            "kvflow runs SwiGLU MLPs ('silu')"
        )

    hidden_size = fields.integer("hidden_size")
    num_heads = fields.integer("num_attention_heads")
    max_positions = fields.integer("max_position_embeddings")
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", model_type == "mistral")
    if uses_window and isinstance(window, int) and 0 < window < max_positions:
        # We attend to the whole context. Up to the window that equals sliding-window
        # attention, so cap the context there rather than compute something else beyond it.
        max_positions = window

    rope_theta, rope_scaling = _rope(raw, source)
    attention_bias = bool(raw.get("attention_bias", False))
    head_dim = raw.get("head_dim")
    eos_ids = _token_ids(raw.get("eos_token_id"), source, "eos_token_id")
    if generation_config is not None:
        more = _token_ids(
            generation_config.get("eos_token_id"), "generation_config.json", "eos_token_id"
        )
        eos_ids += tuple(i for i in more if i not in eos_ids)
    bos = raw.get("bos_token_id")
    config = ModelConfig(
        name=name,
        architecture=architecture,
        vocab_size=fields.integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=fields.integer("intermediate_size"),
        num_hidden_layers=fields.integer("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=fields.integer("num_key_value_heads", default=num_heads),
        head_dim=head_dim if isinstance(head_dim, int) else hidden_size // max(num_heads, 1),
        rms_norm_eps=fields.number("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=eos_ids,
        qkv_bias=model_type == "qwen2" or (model_type == "llama" and attention_bias),
        o_bias=model_type == "llama" and attention_bias,
        mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
    )
    return check_config(config, source)


def _architecture(raw: Mapping[str, Any], source: str) -> str:
    supported = sorted(SUPPORTED_ARCHITECTURES.values())
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs:
        if archs[0] in supported:
            return str(archs[0])
        raise ModelLoadError(
            f"{source}: field 'architectures' = {archs!r} is not supported; "
            f"kvflow runs {', '.join(supported)}"
        )
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[model_type]
    raise ModelLoadError(
        f"{source}: field 'model_type' = {model_type!r} (and no 'architectures') is not "
        f"supported; kvflow runs model types {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _rope(raw: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """RoPE's base and scaling from either transformers 5 or transformers 4 field names."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):  # transformers 5: one dict with the theta inside
        where, scaling = "rope_parameters", dict(params)
        theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:  # transformers 4: a top-level theta and an optional scaling dict
        where, scaling = "rope_scaling", dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: field '{where}.rope_type' = {rope_type!r} is not supported; "
            f"kvflow runs {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if not isinstance(theta, int | float):
        raise ModelLoadError(f"{source}: field 'rope_theta' = {theta!r} must be a number")
    if rope_type == "default":
        return float(theta), None
    return float(theta), RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 0)),
    )


def _token_ids(value: Any, source: str, field_name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise ModelLoadError(f"{source}: field '{field_name}' = {value!r} must be an int or a list")


class _Fields:
    """Typed reads of a JSON object that name the field and file when one is wrong."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self._raw, self._source = raw, source

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._raw.get(key, default)
        if value is None:
            raise ModelLoadError(f"{self._source}: required field '{key}' is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"{self._source}: field '{key}' = {value!r} must be an integer")
        return value

    def number(self, key: str, default: float) -> float:
        value = self._raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{self._source}: field '{key}' = {value!r} must be a number")
        return float(value)
