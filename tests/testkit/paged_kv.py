"""A paged KV cache filled with random tokens on scattered blocks, for attention tests."""

from __future__ import annotations

import torch

from kvflow.engine_worker.model.paged_cache import kv_cache_shape, write_kv

BS = 4  # tokens per block
NB = 48  # blocks in the pool
CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}


def filled_cache(
    lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    values_dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
) -> tuple[torch.Tensor, list[list[int]]]:
    """A cache holding random K/V for sequences of ``lens`` tokens on scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=cache_dtype,
    )
    cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    pool = torch.randperm(NB, generator=g).tolist()
    tables = []
    for n in lens:
        count = -(-n // BS)
        tables.append(pool[:count])
        del pool[:count]
        kv = torch.randn(n, 2, num_kv_heads, head_dim, generator=g).to(values_dtype)
        slots = [tables[-1][p // BS] * BS + p % BS for p in range(n)]
        write_kv(cache, kv.to(device), torch.tensor(slots, device=device))
    return cache, tables
