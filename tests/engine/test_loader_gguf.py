"""Loading GGUF files: names, reversed shapes, the Q/K un-permutation, quantized blocks.

Tiny models are written as Hugging Face folders and converted to GGUF by
``testkit.tiny_gguf``. Two independent references: the same weights loaded from the
folder (no permutation involved), and transformers loading the GGUF itself with its own
un-permutation. Logit tolerance 1e-4 as in test_model_parity (logits of std ~1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from testkit.paged_steps import PagedSteps
from testkit.tiny_gguf import write_tiny_gguf
from testkit.tiny_model import write_tiny_llama
from transformers import AutoModelForCausalLM

from kvflow.engine_worker.model.loader import load_model

ATOL = 1e-4
Q8_0 = gguf.GGMLQuantizationType.Q8_0
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))


def tokens(length: int = 40) -> list[int]:
    return torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(5)).tolist()


def our_logits(path: Path) -> torch.Tensor:
    # Widened to float32, as transformers reads the file; the quantized path is held to this
    # one in test_quant_model.py.
    model, config = load_model(path, quantization="none")
    return PagedSteps(model, config).step({"a": tokens()})["a"]


def transformers_logits(folder: Path, gguf_file: str | None = None) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.float32
    )
    with torch.inference_mode():
        logits: torch.Tensor = reference(torch.tensor([tokens()])).logits[0]
    return logits


@pytest.mark.parametrize("extra", [{}, QWEN2], ids=["llama", "qwen2"])
def test_float32_gguf_loads_the_exact_weights_of_its_source_folder(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    folder = write_tiny_llama(tmp_path / "tiny", num_key_value_heads=1, **extra)
    gguf_path = write_tiny_gguf(folder, tmp_path / "tiny.gguf")
    from_folder, folder_config = load_model(folder)
    from_gguf, gguf_config = load_model(gguf_path)  # F32 tensors: nothing to keep quantized

    assert gguf_config.name == "tiny"
    assert gguf_config.architecture == folder_config.architecture
    assert gguf_config.qkv_bias == folder_config.qkv_bias == bool(extra)
    folder_params = dict(from_folder.named_parameters())
    for name, param in from_gguf.named_parameters():
        assert torch.equal(param, folder_params[name]), name  # bit-exact, biases included


@pytest.mark.parametrize("extra", [{}, QWEN2], ids=["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_reading_the_same_file(
    tmp_path: Path, extra: dict[str, Any]
) -> None:
    folder = write_tiny_llama(tmp_path / "tiny", seed=11, **extra)
    gguf_path = write_tiny_gguf(folder, tmp_path / "tiny-q8.gguf", matrix_type=Q8_0)
    got = our_logits(gguf_path)
    want = transformers_logits(tmp_path, gguf_file=gguf_path.name)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # Q8_0 really changed the weights: the folder's logits differ by far more than ATOL.
    assert (got - our_logits(folder)).abs().max() > 100 * ATOL


def test_llama3_rope_factors_tensor_matches_llama3_scaling_in_the_folder(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    folder = write_tiny_llama(tmp_path / "tiny", rope_theta=500000.0, rope_scaling=scaling)
    gguf_path = write_tiny_gguf(folder, tmp_path / "tiny.gguf")
    _, config = load_model(gguf_path)
    assert config.rope_scaling is not None
    assert config.rope_scaling.rope_type == "freq_factors"
    assert len(config.rope_scaling.freq_factors) == config.head_dim // 2
    torch.testing.assert_close(
        our_logits(gguf_path), transformers_logits(folder), atol=ATOL, rtol=0
    )


def test_linear_rope_scaling_and_tied_embeddings_from_metadata(tmp_path: Path) -> None:
    folder = write_tiny_llama(
        tmp_path / "tiny",
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    gguf_path = write_tiny_gguf(folder, tmp_path / "tiny.gguf")
    model, config = load_model(gguf_path)
    assert config.tie_word_embeddings and model.lm_head is None
    assert config.rope_scaling is not None
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 2.0)
    torch.testing.assert_close(
        our_logits(gguf_path), transformers_logits(folder), atol=ATOL, rtol=0
    )
