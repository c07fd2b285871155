"""``load_model``: a Hugging Face folder, a GGUF file or the default model, ready to run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.default_model import default_model_path
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.hf_folder import folder_tensors, read_hf_config
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.quant.gguf_codes import QuantizedTensor
from kvflow.engine_worker.model.shard import check_tensor_parallel
from kvflow.engine_worker.model.tensor_parallel import TensorParallel
from kvflow.engine_worker.model.weights import load_weights

#: Weight dtypes we run and test. float16 would work too but overflows in some
#: checkpoints' activations without the care bf16 does not need.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
#: auto: a GGUF's quantized matrices stay quantized (``quant/``), the rest runs in the
#: model's dtype; none: every weight widened to the model's dtype (how kvflow ran GGUFs
#: before; a benchmark arm and an escape hatch); fp8: a float checkpoint's projections
#: quantized to FP8 as they load (GPUs with FP8 tensor cores, ``quant/fp8_weight.py``).
QUANTIZATIONS = ("auto", "none", "fp8")


def model_config(path: str | Path | None) -> ModelConfig:
    """The config of the model at ``path`` (``None``: the default), read without its weights."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if resolved.is_dir():
        return read_hf_config(resolved)
    if resolved.is_file() and resolved.suffix == ".gguf":
        from kvflow.engine_worker.model.gguf_file import read_gguf_config

        return read_gguf_config(resolved)
    raise ModelLoadError(
        f"model path {resolved} is neither a folder nor a .gguf file"
        if resolved.exists()
        else f"model path {resolved} does not exist"
    )


def load_model(
    path: str | Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str = "auto",
    tp: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model at ``path`` (``None``: the default SmolLM2) in ``dtype`` on ``device``.

    ``path`` is a Hugging Face folder (``config.json`` + ``*.safetensors``, sharded or not)
    or a ``.gguf`` file, whose quantized matrices stay quantized (``quantization`` "auto")
    or are dequantized to float32 first ("none"; cached, see ``gguf_cache``).
    ``tp``: this rank of a tensor-parallel group, which loads its slice of the weights
    (None: the whole model). Raises ``ModelLoadError`` naming the file, field or tensor at
    fault, or why the model does not split over ``tp``'s ranks.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(
            f"dtype {dtype} is not supported; choose one of {', '.join(map(str, SUPPORTED_DTYPES))}"
        )
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization {quantization!r} is not supported; choose one of "
            f"{', '.join(QUANTIZATIONS)}"
        )
    resolved = default_model_path() if path is None else Path(path).expanduser()
    tensors: Mapping[str, torch.Tensor | QuantizedTensor]
    describe: Mapping[str, str] | None = None
    if resolved.is_dir():
        config = read_hf_config(resolved)
        tensors = folder_tensors(resolved)
    elif resolved.is_file() and resolved.suffix == ".gguf" and quantization == "none":
        from kvflow.engine_worker.model.gguf_cache import read_gguf_cached

        config, tensors, describe = read_gguf_cached(resolved)
    elif resolved.is_file() and resolved.suffix == ".gguf":
        from kvflow.engine_worker.model.gguf_file import read_gguf_tensors

        config, tensors, describe = read_gguf_tensors(resolved, keep_quantized=True)
    elif resolved.exists():
        raise ModelLoadError(
            f"{resolved} is neither a folder nor a .gguf file; pass a Hugging Face model "
            "folder (config.json + *.safetensors) or a .gguf file"
        )
    else:
        raise ModelLoadError(f"model path {resolved} does not exist")

    if tp is not None:
        check_tensor_parallel(config, tp.size, str(resolved))
    if quantization == "fp8" and torch.device(device).type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ModelLoadError(
                f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9: L4, H100, "
                f"H200); this GPU has {capability[0]}.{capability[1]}: drop --quantization fp8"
            )
    model = LlamaForCausalLM(config, dtype=dtype, device=device, tp=tp)
    load_weights(model, tensors, source=str(resolved), describe=describe, fp8=quantization == "fp8")
    model.eval()
    model.requires_grad_(False)
    return model, config
