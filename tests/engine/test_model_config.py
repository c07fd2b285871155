"""Parsing config.json into ModelConfig: spellings, defaults, and what each architecture implies."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.engine_worker.model.config import ModelConfig, RopeScaling, config_from_hf

LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def parse(**fields: Any) -> ModelConfig:
    return config_from_hf({**LLAMA, **fields}, name="m")


def test_transformers_4_and_5_rope_spellings_parse_alike() -> None:
    v4 = parse(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    v5 = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    oldest = parse(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    assert v4 == v5 == oldest
    assert v4.rope_theta == 500000.0
    assert v4.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_defaults_when_fields_are_absent() -> None:
    config = config_from_hf(
        {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "rms_norm_eps")},
        name="m",
    )
    assert config.num_key_value_heads == 32  # no GQA unless stated
    assert config.head_dim == 4096 // 32
    assert (config.rope_theta, config.rope_scaling) == (10000.0, None)
    assert config.tie_word_embeddings is False
    assert parse(head_dim=256).head_dim == 256  # stated head size wins over the quotient


def test_generation_config_adds_end_of_turn_tokens() -> None:
    config = config_from_hf(
        LLAMA, name="m", generation_config={"eos_token_id": [128001, 128008, 128009]}
    )
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert parse(eos_token_id=None, bos_token_id=None).eos_token_ids == ()


@pytest.mark.parametrize(
    ("fields", "biases"),
    [
        ({}, (False, False, False)),
        ({"attention_bias": True}, (True, True, False)),
        ({"mlp_bias": True}, (False, False, True)),
        ({"architectures": ["Qwen2ForCausalLM"]}, (True, False, False)),
        ({"architectures": ["MistralForCausalLM"], "attention_bias": True}, (False, False, False)),
    ],
    ids=["llama", "llama-attention-bias", "llama-mlp-bias", "qwen2", "mistral-ignores-flag"],
)
def test_bias_flags_follow_the_architecture(
    fields: dict[str, Any], biases: tuple[bool, bool, bool]
) -> None:
    config = parse(**fields)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == biases


def test_model_type_stands_in_for_missing_architectures() -> None:
    raw = {k: v for k, v in LLAMA.items() if k != "architectures"}
    assert config_from_hf({**raw, "model_type": "qwen2"}, name="m").architecture == (
        "Qwen2ForCausalLM"
    )


def test_sliding_window_caps_the_context_only_where_it_is_used() -> None:
    mistral = parse(architectures=["MistralForCausalLM"], sliding_window=4096)
    assert mistral.max_position_embeddings == 4096
    no_window = parse(architectures=["MistralForCausalLM"], sliding_window=None)
    assert no_window.max_position_embeddings == 131072
    qwen2_off = parse(
        architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=4096
    )
    assert qwen2_off.max_position_embeddings == 131072


def test_json_round_trip_keeps_every_field() -> None:
    config = parse(
        rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, mlp_bias=True
    )
    assert ModelConfig.from_json(config.to_json()) == config
    factors = RopeScaling("freq_factors", freq_factors=(1.0, 2.5, 8.0))
    with_factors = ModelConfig(**{**config.__dict__, "head_dim": 6, "rope_scaling": factors})
    restored = ModelConfig.from_json(with_factors.to_json())
    assert restored == with_factors
    assert hash(restored) == hash(with_factors)  # usable as a cache key
