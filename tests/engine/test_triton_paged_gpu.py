"""The compiled paged decode kernel on a GPU, through ``paged_attention``: the engine picks
it on CUDA and it agrees with the CPU's gather path (bench/gpu_tests.sh runs it; skipped
elsewhere). test_triton_paged.py checks the same kernel on the CPU under Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch
from testkit.paged_kv import BS, CACHE_DTYPES, NB, filled_cache

from kvflow.engine_worker.model.attention import paged_attention
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here")
@pytest.mark.parametrize("cache_name", list(CACHE_DTYPES))
def test_paged_attention_on_cuda_reads_the_cache_in_place(cache_name: str) -> None:
    """``paged_attention`` on a GPU takes the compiled kernel and agrees with the CPU path."""
    cache_dtype = CACHE_DTYPES[cache_name]
    dtype = torch.bfloat16 if cache_dtype != torch.float32 else torch.float32
    lens = [1, 5, 16, 33, 64, 7]
    cache, tables = filled_cache(
        lens,
        num_kv_heads=2,
        head_dim=128,
        cache_dtype=cache_dtype,
        values_dtype=dtype,
        seed=7,
        device="cuda",
    )
    assert uses_paged_kernel(torch.device("cuda"), BS)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(len(lens), 8, 128, generator=g).to(dtype)
    new_kv = torch.randn(len(lens), 2, 2, 128, generator=g).to(dtype)
    cpu_cache = cache.cpu()
    steps = []
    for device, c in (("cuda", cache), ("cpu", cpu_cache)):
        meta = AttentionMetadata.build(
            query_lens=[1] * len(lens),
            context_lens=[n + 1 for n in lens],
            block_tables=[t + [NB - 1] for t in tables],  # room for the new token
            block_size=BS,
            device=device,
        )
        assert all((d.context_lens is not None) == (device == "cuda") for d in meta.decodes)
        steps.append(paged_attention(q.to(device), new_kv.to(device), c, meta, 128**-0.5))
    torch.testing.assert_close(steps[0].cpu().float(), steps[1].float(), atol=2e-2, rtol=2e-2)
