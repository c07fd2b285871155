"""The model shapes the GPU check runs, as Hugging Face ``config.json`` dicts: the engine
parses them with its own ``config_from_hf`` and transformers with ``LlamaConfig``, so both
sides read one description (the per-size plans that name them: plan.py). Pure data, no torch.
"""

from __future__ import annotations

from typing import Any


def llama_config(
    *,
    vocab: int,
    hidden: int,
    ffn: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope_theta: float,
    max_positions: int,
    tied: bool,
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


# meta-llama/Meta-Llama-3-8B's config.json (rope_scaling none: Llama 3, not 3.1).
LLAMA3_8B = llama_config(
    vocab=128256,
    hidden=4096,
    ffn=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_positions=8192,
    tied=False,
)
# SmolLM2-135M-Instruct (shared/facts/default-model.md): 30 layers, GQA 9/3, tied embeddings.
SMOLLM2_135M = llama_config(
    vocab=49152,
    hidden=576,
    ffn=1536,
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_positions=8192,
    tied=True,
)
# A few hundred thousand parameters: every stage runs on two CPU cores in seconds.
TINY = llama_config(
    vocab=1024,
    hidden=64,
    ffn=128,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_positions=1024,
    tied=False,
)
# meta-llama/Meta-Llama-3-70B's layers (GQA 64/8, 8192 wide), 8 of its 80: a slice that
# runs every kernel at the 70B's sizes in 18 GB of bf16 (the whole would not fit one GPU).
LLAMA3_70B_SLICE = llama_config(
    vocab=128256,
    hidden=8192,
    ffn=28672,
    layers=8,
    heads=64,
    kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_positions=8192,
    tied=False,
)
# The CPU mode's stand-in for the slice: the same 8:1 grouping of query to KV heads.
TINY_GQA8 = llama_config(
    vocab=1024,
    hidden=128,
    ffn=256,
    layers=2,
    heads=8,
    kv_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    max_positions=1024,
    tied=False,
)
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b-slice": LLAMA3_70B_SLICE,
    "smollm2": SMOLLM2_135M,
    "tiny": TINY,
    "tiny-gqa8": TINY_GQA8,
}
