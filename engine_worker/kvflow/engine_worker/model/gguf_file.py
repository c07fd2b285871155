"""Reading a GGUF file (llama.cpp's format) as a config plus Hugging Face-named tensors.

Three things differ from a Hugging Face checkpoint, and each is undone here:

- names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``;
- shapes: GGUF lists dimensions innermost first, so a ``[out, in]`` matrix reads
  ``[in, out]``; the data itself is row-major ``[out, in]``;
- Q and K rows of Llama files are permuted per head, because llama.cpp's RoPE rotates
  adjacent pairs of dimensions (2j, 2j+1) while Hugging Face's rotates (j, j + head_dim/2).
  Qwen2 files are not permuted: llama.cpp runs them with the rotate-half convention.

Quantized matrices of the types ``quant/gguf_codes.py`` reads stay in their blocks
(``QuantizedTensor``, decoded when the loader reaches them) unless the caller asks for
float32 (``keep_quantized=False``, ``--quantization none``); then, and for every other
tensor, ``gguf.quants.dequantize`` widens them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from kvflow.engine_worker.model.config import ModelConfig, RopeScaling, check_config
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.quant.gguf_codes import QUANTIZED_TYPES, QuantizedTensor

#: ``general.architecture`` values we run (Mistral files say "llama").
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Architectures whose converter permuted the Q/K rows for interleaved RoPE.
_PERMUTED = {"LlamaForCausalLM"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FACTORS = "rope_freqs.weight"  # Llama 3.1's frequency divisors, precomputed

GgufContents = tuple[ModelConfig, Mapping[str, torch.Tensor], dict[str, str]]
#: Tensors as read: float32, or a quantized matrix still in its blocks.
GgufTensors = Mapping[str, torch.Tensor | QuantizedTensor]
_FLOAT_TYPES = ("F32", "F16", "BF16")


def read_gguf(path: Path) -> GgufContents:
    """The config, the float32 tensors under Hugging Face names, and each one's GGUF name."""
    config, tensors, names = read_gguf_tensors(path, keep_quantized=False)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    return config, tensors, names  # type: ignore[return-value]  # widened: all tensors


def read_gguf_config(path: Path) -> ModelConfig:
    """The config alone (to check a model before loading it)."""
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from err
    return _config(reader, {t.name: t for t in reader.tensors}, path)


def read_gguf_tensors(
    path: Path, *, keep_quantized: bool
) -> tuple[ModelConfig, GgufTensors, dict[str, str]]:
    """Like ``read_gguf``; with ``keep_quantized`` a quantized matrix stays in its blocks
    (a ``QuantizedTensor``), and a type kvflow cannot multiply quantized is refused."""
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {err}") from err
    by_name = {t.name: t for t in reader.tensors}
    config = _config(reader, by_name, path)
    num_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    unpermute = config.architecture in _PERMUTED

    tensors: dict[str, torch.Tensor | QuantizedTensor] = {}
    gguf_names: dict[str, str] = {}
    for name, tensor in by_name.items():
        if name == _ROPE_FACTORS:
            continue  # folded into config.rope_scaling
        hf_name, part = _hf_name(name, path)
        gguf_names[hf_name] = name
        kind = tensor.tensor_type.name
        if keep_quantized and kind not in _FLOAT_TYPES:
            tensors[hf_name] = _quantized(tensor, path, num_heads.get(part) if unpermute else None)
            continue
        array = _dequantize(tensor, path)
        if unpermute and part in num_heads:
            array = unpermute_rope_rows(array, num_heads[part], name, path)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = array.copy()  # a float32 tensor arrives as a read-only view of the file
        tensors[hf_name] = torch.from_numpy(array)
    return config, tensors, gguf_names


def _quantized(tensor: ReaderTensor, path: Path, rope_heads: int | None) -> QuantizedTensor:
    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if kind not in QUANTIZED_TYPES or len(shape) != 2:
        raise ModelLoadError(
            f"{path}: tensor '{tensor.name}' is stored as {kind}, which kvflow does not "
            f"multiply quantized (it runs {', '.join(QUANTIZED_TYPES)}, F32, F16 and BF16); "
            "pass --quantization none to widen every weight to float instead"
        )
    rows, cols = shape
    order = None
    if rope_heads is not None:  # the row order that undoes llama.cpp's per-head permutation
        order = unpermute_rope_rows(np.arange(rows)[:, None], rope_heads, tensor.name, path)[:, 0]
    return QuantizedTensor(kind, tensor.data, (rows, cols), order)


def unpermute_rope_rows(array: np.ndarray, num_heads: int, name: str, path: Path) -> np.ndarray:
    """Reorder each head's rows from interleaved pairs back to rotate-half halves.

    Within a head, llama.cpp's converter moved row ``j`` to ``2j`` and row ``j + D/2`` to
    ``2j + 1``. Viewing the head's rows as ``[D/2, 2]`` (pair, member) and transposing to
    ``[2, D/2]`` puts every first member back in the first half.
    """
    rows = array.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(
            f"{path}: tensor '{name}' has {rows} rows, which do not split into {num_heads} "
            "heads of even size; the file's head counts disagree with its tensors"
        )
    per_head = array.reshape(num_heads, rows // num_heads // 2, 2, *array.shape[1:])
    return per_head.swapaxes(1, 2).reshape(array.shape)


def _hf_name(name: str, path: Path) -> tuple[str, str]:
    """``blk.3.attn_q.weight`` -> (``model.layers.3.self_attn.q_proj.weight``, ``attn_q``)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], ""
    pieces = name.split(".")
    if len(pieces) == 4 and pieces[0] == "blk" and pieces[1].isdigit():
        _, layer, part, kind = pieces
        if part in _LAYER_PARTS and kind in ("weight", "bias"):
            return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}", part
    raise ModelLoadError(
        f"{path}: tensor '{name}' has no place in a Llama-family decoder; the file holds "
        "layers kvflow does not implement"
    )


def _dequantize(tensor: ReaderTensor, path: Path) -> np.ndarray:
    try:
        flat = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ModelLoadError(
            f"{path}: tensor '{tensor.name}' is stored as {tensor.tensor_type.name}, which the "
            "gguf package cannot dequantize; use a file quantized as Q8_0, Q4_K, Q6_K or "
            "similar, or an unquantized Hugging Face folder"
        ) from err
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # innermost first in GGUF
    array: np.ndarray = flat.reshape(shape).astype(np.float32, copy=False)
    return array


def _config(reader: GGUFReader, tensors: dict[str, ReaderTensor], path: Path) -> ModelConfig:
    meta = _Metadata(reader, path)
    arch = meta.string("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: field 'general.architecture' = {arch!r} is not supported; kvflow runs "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    if meta.integer(f"{arch}.expert_count", 0) > 0:
        raise ModelLoadError(
            f"{path}: field '{arch}.expert_count' = {meta.integer(f'{arch}.expert_count', 0)}: "
            "mixture-of-experts models are not supported"
        )
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // max(heads, 1))
    rope_dims = meta.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: field '{arch}.rope.dimension_count' = {rope_dims} differs from the head "
            f"size {head_dim}; partial rotary embeddings are not supported"
        )
    embedding = tensors.get("token_embd.weight")
    vocab_default = int(embedding.shape[-1]) if embedding is not None else None
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.optional_integer(f"tokenizer.ggml.{key}")
        if token is not None and token not in eos_ids:
            eos_ids.append(token)
    config = ModelConfig(
        name=path.stem,
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=meta.integer(f"{arch}.vocab_size", vocab_default),
        hidden_size=hidden,
        intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
        num_hidden_layers=meta.integer(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.integer(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(meta, arch, tensors.get(_ROPE_FACTORS), path),
        max_position_embeddings=meta.integer(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.optional_integer("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos_ids),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
    )
    return check_config(config, str(path))


def _rope_scaling(
    meta: _Metadata, arch: str, factors: ReaderTensor | None, path: Path
) -> RopeScaling | None:
    kind = meta.string(f"{arch}.rope.scaling.type", "none")
    if factors is not None and kind == "none":
        divisors = _dequantize(factors, path).reshape(-1)
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in divisors))
    if kind == "none":
        return None
    if kind == "linear" and factors is None:
        return RopeScaling("linear", factor=meta.number(f"{arch}.rope.scaling.factor"))
    raise ModelLoadError(
        f"{path}: field '{arch}.rope.scaling.type' = {kind!r}"
        + (f" with a '{_ROPE_FACTORS}' tensor" if factors is not None else "")
        + " is not supported; kvflow runs 'none', 'linear', or per-frequency factors"
    )


class _Metadata:
    """Typed reads of GGUF key-value metadata that name the key when one is wrong."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._fields, self._path = reader.fields, path

    def _get(self, key: str, default: Any) -> Any:
        field = self._fields.get(key)
        if field is None:
            if default is None:
                raise ModelLoadError(f"{self._path}: required metadata field '{key}' is missing")
            return default
        return field.contents()

    def string(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self._path}: field '{key}' = {value!r} must be a string")
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelLoadError(f"{self._path}: field '{key}' = {value!r} must be an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        return self.integer(key) if key in self._fields else None

    def number(self, key: str, default: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{self._path}: field '{key}' = {value!r} must be a number")
        return float(value)
