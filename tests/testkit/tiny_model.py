"""A seeded random Llama-family model written as a Hugging Face folder, for fast tests.

The defaults make about 7 M parameters (two 49,152 x 64 embedding tables dominate), written
in tens of milliseconds, byte-identical for the same arguments. The vocabulary matches
SmolLM2's so the same folder can be paired with SmolLM2's tokenizer.

Weights are Gaussian with standard deviation ``1 / sqrt(fan_in)``: activations keep unit
scale through the layers, attention scores are O(1) (peaked but not one-hot), and logits
spread about 1 apart, so greedy tokens depend on the prompt and parity tests compare
numbers that matter. (The usual 0.02 leaves a 64-wide model's attention nearly uniform,
which would hide a wrong RoPE.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int = 49152,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    eos_token_id: int = 2,
    **extra_config: Any,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into the folder ``path``; return it.

    ``extra_config`` adds or overrides config fields, and the tensors follow: e.g.
    ``architectures=["Qwen2ForCausalLM"], model_type="qwen2"`` adds q/k/v biases,
    ``attention_bias=True`` adds Llama's q/k/v/o biases, ``rope_scaling={...}`` passes
    through, ``head_dim=32`` decouples the head size from ``hidden_size``.
    """
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
        **extra_config,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_random_weights(config, seed), str(path / "model.safetensors"))
    return path


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    is_qwen2 = config["model_type"] == "qwen2"
    attention_bias = bool(config.get("attention_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    tensors: dict[str, torch.Tensor] = {}

    def gaussian(name: str, *shape: int, std: float) -> None:
        tensors[name] = torch.randn(*shape, generator=generator) * std

    def matrix(name: str, rows: int, cols: int, bias: bool = False) -> None:
        gaussian(f"{name}.weight", rows, cols, std=cols**-0.5)
        if bias:
            gaussian(f"{name}.bias", rows, std=0.1)

    def norm(name: str) -> None:
        # Not all ones, so that a norm weight applied to the wrong tensor shows.
        tensors[name] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)

    gaussian("model.embed_tokens.weight", config["vocab_size"], hidden, std=hidden**-0.5)
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        norm(f"{layer}.input_layernorm.weight")
        matrix(f"{layer}.self_attn.q_proj", q_rows, hidden, is_qwen2 or attention_bias)
        matrix(f"{layer}.self_attn.k_proj", kv_rows, hidden, is_qwen2 or attention_bias)
        matrix(f"{layer}.self_attn.v_proj", kv_rows, hidden, is_qwen2 or attention_bias)
        matrix(f"{layer}.self_attn.o_proj", hidden, q_rows, attention_bias)
        norm(f"{layer}.post_attention_layernorm.weight")
        matrix(f"{layer}.mlp.gate_proj", ffn, hidden, mlp_bias)
        matrix(f"{layer}.mlp.up_proj", ffn, hidden, mlp_bias)
        matrix(f"{layer}.mlp.down_proj", hidden, ffn, mlp_bias)
    norm("model.norm.weight")
    if not config["tie_word_embeddings"]:
        matrix("lm_head", config["vocab_size"], hidden)
    return tensors
