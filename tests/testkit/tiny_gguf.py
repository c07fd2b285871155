"""Convert a tiny Hugging Face folder (``write_tiny_llama``) into a GGUF file, llama.cpp-style.

Tests use it to exercise the GGUF path (names, reversed shapes, the Q/K row permutation,
quantized blocks) in milliseconds, and transformers can load the result too
(``gguf_file=``), which makes an independent reference for the permutation.

Written from the GGUF conventions, not from llama.cpp's converter: the Q/K rows of each
head are moved so that llama.cpp's adjacent-pair RoPE sees the pairs that Hugging Face's
rotate-half RoPE rotates (row ``j`` to ``2j``, row ``j + D/2`` to ``2j + 1``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import load_file

from testkit.quant_blocks import random_blocks

_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


QuantType = gguf.GGMLQuantizationType


def write_tiny_gguf(
    hf_folder: Path,
    path: Path,
    *,
    matrix_type: QuantType = QuantType.F32,
    part_types: dict[str, QuantType] | None = None,
    architecture: str | None = None,
) -> Path:
    """Write ``hf_folder``'s model to the file ``path``; return ``path``.

    ``matrix_type`` stores every 2-D weight that way (e.g. ``Q8_0``; norms and biases stay
    F32, as llama.cpp keeps them); ``part_types`` overrides it per GGUF part (``attn_v``,
    ``token_embd``, ``output``...), as llama.cpp's mixed files (Q4_K_M) do. A type the gguf
    package cannot quantize (the K-quants) gets random codes of the weights' scale
    (``quant_blocks``), not the folder's weights. ``architecture`` overrides
    ``general.architecture`` (to test rejection). Llama 3 RoPE scaling becomes a
    ``rope_freqs.weight`` tensor.
    """
    config: dict[str, Any] = json.loads((hf_folder / "config.json").read_text())
    is_qwen2 = config["model_type"] == "qwen2"
    arch = architecture or ("qwen2" if is_qwen2 else "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(hf_folder.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(head_dim, config))

    rope_heads = {} if is_qwen2 else {"attn_q": heads, "attn_k": kv_heads}
    for index, (name, tensor) in enumerate(
        sorted(load_file(str(hf_folder / "model.safetensors")).items())
    ):
        gguf_name = _gguf_name(name)
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        array = _interleave_rope_rows(tensor, rope_heads[part]) if part in rope_heads else tensor
        kind = (part_types or {}).get(part, matrix_type)
        if array.ndim == 2 and kind != QuantType.F32:
            writer.add_tensor(gguf_name, _quantize(array, kind, seed=index), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quantize(array: np.ndarray, kind: QuantType, *, seed: int) -> np.ndarray:
    try:
        quantized: np.ndarray = gguf.quants.quantize(array, kind)
    except NotImplementedError:
        rows, cols = array.shape
        return random_blocks(kind.name, rows, cols, std=float(array.std()), seed=seed)
    return quantized


def _gguf_name(name: str) -> str:
    simple = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in simple:
        return simple[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def _interleave_rope_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    half = array.shape[0] // num_heads // 2
    halves = array.reshape(num_heads, 2, half, *array.shape[1:])  # (head, half, pair)
    return halves.swapaxes(1, 2).reshape(array.shape)  # (head, pair, member)


def _llama3_divisors(head_dim: int, config: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1 RoPE scaling, from its published formula."""
    s = config["rope_scaling"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * config["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
