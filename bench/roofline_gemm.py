"""The model's side of bench/engine_roofline.py: the bytes one decode step reads, the
weights a token multiplies by, and the decode GEMMs alone, timed (the GEMM ceiling)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from kvflow.engine_worker.model.linear import Linear, head_logits
from kvflow.engine_worker.model.llama import LlamaForCausalLM


def decode_ops(model: LlamaForCausalLM) -> list[tuple[int, Any]]:
    """Every matrix product one decode step does, in the model's order, as (input width,
    product): ``F.linear`` over a dense weight, the module's own kernel over a quantized
    one, then the LM head as the model computes it."""
    ops: list[tuple[int, Any]] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(lin, Linear)
            w = lin.weight
            op = lin if w is None else (lambda x, w=w: F.linear(x, w))
            ops.append((lin.in_features, op))
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    hidden = model.config.hidden_size
    if head.weight is not None:
        ops.append((hidden, lambda x, w=head.weight: F.linear(x, w)))
    else:
        ops.append((hidden, lambda x: head_logits(x, head)))
    return ops


def step_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads, as stored (quantized codes and scales
    included): every weight tensor once (the state dict: no RoPE tables), less the
    embedding table unless it is also the LM head (a step reads one row of it otherwise),
    less a quantized embedding's plain-order copy of its codes (rows are read from it)."""
    seen: set[int] = set()
    total = 0
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("row_codes") or t.data_ptr() in seen:
            continue
        if model.lm_head is not None and name.startswith("embed_tokens."):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def matmul_params(config: Any) -> int:
    """Weights a decode token multiplies by: every layer's projections and the LM head."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    mlp = 3 * h * config.intermediate_size
    return config.num_hidden_layers * (attn + mlp) + config.vocab_size * h


def gemm_ceiling_s(
    ops: list[tuple[int, Any]], batch: int, passes: int, dtype: torch.dtype
) -> list[float]:
    """Seconds of each pass over every product at this batch size.

    Inputs are preallocated per input width and nothing depends on a previous output, so
    this is the GEMMs alone; a warm-up pass comes first."""
    inputs = {width: torch.randn(batch, width, dtype=dtype) for width, _ in ops}
    times: list[float] = []
    with torch.inference_mode():
        for i in range(passes + 1):
            start = time.perf_counter()
            for width, op in ops:
                op(inputs[width])
            if i:  # the first pass is the warm-up
                times.append(time.perf_counter() - start)
    return times
