"""``paged_attention`` called with K and V apart, as attention tests build them.

The model hands ``paged_attention`` one ``[T, 2, Hkv, D]`` slice (K then V of each token,
the cache's row layout); tests make K and V separately and stack them here.
"""

from __future__ import annotations

import torch

from kvflow.engine_worker.model.attention import paged_attention
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``paged_attention`` with K and V apart, side by side as the model hands them over."""
    return paged_attention(q, torch.stack((k, v), dim=1), cache, meta, scale)
