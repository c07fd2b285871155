"""Reading a Hugging Face model folder: ``config.json`` plus one or more safetensors files.

A ``tokenizer.json`` may sit beside them; the worker speaks token ids and never reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kvflow.engine_worker.model.config import ModelConfig, config_from_hf
from kvflow.engine_worker.model.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> ModelConfig:
    """Parse ``folder/config.json`` (and ``generation_config.json`` when present)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{config_path} is missing: a Hugging Face model folder needs config.json next to "
            "its *.safetensors files (or pass the path of a .gguf file instead)"
        )
    generation_path = folder / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    return config_from_hf(
        _read_json(config_path),
        name=folder.name,
        source=str(config_path),
        generation_config=generation,
    )


def folder_tensors(folder: Path) -> SafetensorsTensors:
    """The tensors of every ``*.safetensors`` file in ``folder``, checked against its index."""
    files = sorted(folder.glob("*.safetensors"))
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        shards = sorted(set(_read_json(index_path).get("weight_map", {}).values()))
        for shard in shards:
            if not (folder / shard).is_file():
                raise ModelLoadError(
                    f"{folder / shard} is missing: {index_path} lists it as a shard; "
                    "download the whole model folder again"
                )
    if not files:
        hint = (
            "; pytorch_model.bin is not supported, save the model with safetensors"
            if (folder / "pytorch_model.bin").exists()
            else ""
        )
        raise ModelLoadError(f"{folder} has no *.safetensors weight file{hint}")
    return SafetensorsTensors(files)


class SafetensorsTensors(Mapping[str, torch.Tensor]):
    """Every tensor of some safetensors files by name, each read when first asked for.

    Reading lazily (the files are memory-mapped) keeps peak memory at the model plus one
    tensor, not two copies of the model.
    """

    def __init__(self, files: list[Path]) -> None:
        self._handles: dict[str, Any] = {}
        self.metadata: dict[str, str] = {}  # the first file's free-form header
        for file in files:
            try:
                handle: Any = safe_open(str(file), framework="pt")
            except (OSError, SafetensorError) as err:
                raise ModelLoadError(f"{file} is not a readable safetensors file: {err}") from err
            if not self._handles:
                self.metadata = handle.metadata() or {}
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._handles.setdefault(name, handle)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor: torch.Tensor = self._handles[name].get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{path} is not readable JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw
