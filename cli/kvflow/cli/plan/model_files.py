"""A ``ModelSpec`` from a Hugging Face model folder (``config.json``) or a GGUF file.

Only the shape is read, never a tensor's data: a 140 GB checkpoint plans in a second.
The folder's ``config.json`` goes through the engine's own parser, so the planner accepts
exactly the architectures a kvflow worker runs. A GGUF file's tensors are already stored
quantized; their byte count (from the tensor index) gives the bytes per parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.models import ModelSpec, from_shape
from kvflow.engine_worker.model.config import config_from_hf
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.sim.hardware import ModelShape


def read_model_path(path: Path) -> ModelSpec:
    """The model at ``path``: a folder with config.json, or a .gguf file."""
    if path.is_dir():
        return _read_folder(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _read_gguf(path)
    raise PlanError(
        f"{path}: not a model folder (with config.json) or a .gguf file; "
        "or name a preset with --model, or describe the model with --params-b and the "
        "--layers/--heads/--kv-heads/--head-dim flags"
    )


def _read_folder(folder: Path) -> ModelSpec:
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except OSError as exc:
        raise PlanError(f"cannot read {config_path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{config_path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{config_path}: expected a JSON object")
    try:
        config = config_from_hf(raw, name=folder.name, source=str(config_path))
    except ModelLoadError as exc:
        raise PlanError(str(exc)) from None
    shape = ModelShape(
        config.name,
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    return from_shape(
        shape,
        tied_embeddings=config.tie_word_embeddings,
        max_context_tokens=config.max_position_embeddings,
        source=str(folder),
        stored_bytes_per_param=_quantized_bytes(raw.get("quantization_config")),
    )


def _quantized_bytes(quantization: Any) -> float | None:
    """Bytes per weight of a pre-quantized checkpoint (GPTQ/AWQ ``bits``, ``fp8``), else None.

    ``torch_dtype`` is no signal: engines serve float32 checkpoints in 16 bits.
    """
    if not isinstance(quantization, dict):
        return None
    bits = quantization.get("bits")
    if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
        return bits / 8
    if quantization.get("quant_method") == "fp8":
        return 1.0
    return None


def _read_gguf(path: Path) -> ModelSpec:
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        raise PlanError(
            "reading a GGUF file needs the gguf package: pip install 'kvflow[router]' "
            "(or pip install gguf)"
        ) from None
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path} is not a readable GGUF file: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}

    def field(key: str, default: int | None = None) -> int:
        entry = reader.fields.get(key)
        value: Any = entry.contents() if entry is not None else default
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{path}: metadata field '{key}' is missing or not an integer")
        return value

    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else None
    if not isinstance(arch, str):
        raise PlanError(f"{path}: metadata field 'general.architecture' is missing")
    embedding = tensors.get("token_embd.weight")
    hidden = field(f"{arch}.embedding_length")
    heads = field(f"{arch}.attention.head_count")
    shape = ModelShape(
        path.stem,
        field(f"{arch}.vocab_size", int(embedding.shape[-1]) if embedding is not None else None),
        hidden,
        field(f"{arch}.feed_forward_length"),
        field(f"{arch}.block_count"),
        heads,
        field(f"{arch}.attention.head_count_kv", heads),
        field(f"{arch}.attention.key_length", hidden // max(heads, 1)),
    )
    num_elements = sum(int(t.n_elements) for t in reader.tensors)
    num_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return from_shape(
        shape,
        tied_embeddings="output.weight" not in tensors,
        max_context_tokens=field(f"{arch}.context_length"),
        source=str(path),
        stored_bytes_per_param=num_bytes / max(num_elements, 1),
    )
