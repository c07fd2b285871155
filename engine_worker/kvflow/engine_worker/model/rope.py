"""Rotary position embeddings, looked up by each token's absolute position.

Tokens of many sequences arrive flattened, each at its own position, so the angles are a
table ``[max_positions, head_dim]`` indexed by position rather than a range per batch. The
table is float32 whatever the model's dtype: at position 8,000 a bf16 angle would be off by
tens of radians. SmolLM2's 8,192 x 64 table costs 4 MiB for cos and sin together.

Layout: dimension ``i`` of a head rotates with dimension ``i + head_dim / 2`` (the "rotate
half" convention of Hugging Face checkpoints); GGUF files permute Q and K rows for the
interleaved convention, and the GGUF loader undoes that.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from kvflow.engine_worker.model import elementwise
from kvflow.engine_worker.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The ``head_dim / 2`` rotation speeds (radians per position), in float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    assert scaling.rope_type == "llama3", scaling
    return _llama3_frequencies(inv_freq, scaling)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Slow each frequency by how far its wavelength sits past the trained context.

    Wavelengths shorter than ``original / high_freq_factor`` positions already repeat
    within the trained context and keep their speed; those longer than
    ``original / low_freq_factor`` are slowed by ``factor``; in between the speed is a
    linear blend of the two, weighted by how many times the wave fits in the original
    context.
    """
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    fits = original / wavelength  # times the wave repeats in the trained context
    blend = (fits - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    is_long = wavelength > original / scaling.low_freq_factor
    is_short = wavelength < original / scaling.high_freq_factor
    slowed = torch.where(is_long, inv_freq / scaling.factor, blended)
    return torch.where(is_short, inv_freq, slowed)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position; ``forward`` picks a step's rows."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        half = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        angles = torch.cat([half, half], dim=-1)
        # The sine's first half negated: rotate-half's sign lives in the table, not the step.
        signs = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
        # Not persistent: derived from the config, so never part of a checkpoint.
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", (angles.sin() * signs).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of tokens at ``positions`` ``[T]``, once per step for every layer.

        The looked-up rows are cast, not the table: the rotation runs in the model's dtype
        (as the reference implementation does) from angles that were exact in float32.
        """
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, head_dim]: every head alike
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return Rotation(cos, sin)


class Rotation(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor  # signed: -sin on the first half, +sin on the second

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, num_heads, head_dim]`` in place: dimension i with i + head_dim / 2.

        ``x * cos + cat(-second, first) * sin``, as three ops: the halves swapped by one
        ``flip`` (a copy, so writing ``x`` after is safe) and the sign carried by the table.
        In place because ``x`` is a view of the model's fused QKV output, whose K part then
        goes to the cache as it stands. Returns ``x``."""
        if elementwise.rope_(x, self.cos, self.sin) is not None:
            return x  # a decode step's few float32 rows: one C call (elementwise.py)
        head_dim = x.shape[-1]
        swapped = x.view(*x.shape[:-1], 2, head_dim // 2).flip(-2).view(x.shape)
        return torch.addcmul(x * self.cos, swapped, self.sin, out=x)
