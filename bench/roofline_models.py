"""Models of real shapes with random weights for bench/engine_roofline.py, built in memory.

SmolLM2-135M (the built-in model) reads 67 MB of 4-bit weights a decode step: at this
machine's streamed bandwidth that is about 2 ms, while its 30 layers run some 600 small
ops of 5-20 us each. Its batch-1 step is bound by per-op cost, not by memory, and says
little about the bandwidth roofline. ``llama3-1b`` is Llama-3.2-1B's shape (16 layers,
hidden 2048, GQA 32/8, a tied 128 K-token vocabulary): 1.24 B weights, 2.5 GB a step in
bf16, where the weights' bytes dominate a step as they do for the models people run on
CPUs.

Weights are drawn as the GPU check draws them (``gpu.models.fill_random_``: N(0,
1/fan_in), so activations keep their scale). ``q4`` quantizes each matrix of the same
draw to 4-bit planes, one plane, groups of 32, a min-max scale and zero per group (what a
Q4_1 GGUF holds), through the engine's own ``Int4Weight``: the weights the worker runs a
GGUF with by default, with float32 activations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gpu.models import engine_config, kvflow_random
from gpu.shapes import llama_config

from kvflow.engine_worker.model.linear import Embedding, Linear
from kvflow.engine_worker.model.quant.int4_weight import Int4Weight
from kvflow.engine_worker.model.quant.planes import Int4Planes

# meta-llama/Llama-3.2-1B's config.json (its rope scaling left out: it changes no cost).
LLAMA3_1B = llama_config(
    vocab=128256,
    hidden=2048,
    ffn=8192,
    layers=16,
    heads=32,
    kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    max_positions=131072,
    tied=True,
)
RANDOM_SHAPES = {"llama3-1b": LLAMA3_1B}
Q4_GROUP = 32


def random_model(name: str, dtype: str, seed: int = 0) -> tuple[Any, Any]:
    """``(model, config)`` as ``load_model`` returns them: ``dtype`` float32 or bfloat16
    (dense), or q4 (4-bit planes, float32 activations)."""
    config = engine_config(RANDOM_SHAPES[name], name)
    dense = torch.float32 if dtype == "q4" else getattr(torch, dtype)
    model = kvflow_random(config, dense, "cpu", seed)
    if dtype == "q4":
        quantize_int4_(model)
    return model, config


def quantize_int4_(model: torch.nn.Module) -> None:
    """Every ``Linear`` and ``Embedding`` of ``model`` held as 4-bit planes instead."""
    for module in list(model.modules()):
        if isinstance(module, Linear) and module.weight is not None:
            module.quantize([Int4Weight(min_max_planes(module.weight.data))])
        elif isinstance(module, Embedding) and module.weight is not None:
            module.quantize(Int4Weight(min_max_planes(module.weight.data)))


def min_max_planes(weight: torch.Tensor, group: int = Q4_GROUP) -> Int4Planes:
    """``weight [rows, cols]`` as one plane of 4-bit codes: per group of ``group`` columns,
    ``W ~ (code - 8) * scale + zero`` with the group's minimum at code 0 and maximum at 15."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    low = grouped.amin(dim=-1)
    scale = ((grouped.amax(dim=-1) - low) / 15).clamp_min(1e-12)
    codes = ((grouped - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
    return Int4Planes(
        codes=codes.to(torch.uint8).view(rows, cols).numpy(),
        scales=scale.numpy().astype(np.float32),
        zeros=(low + 8 * scale).numpy().astype(np.float32),
        group_size=group,
        num_planes=1,
    )
