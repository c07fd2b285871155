"""Paged attention over a quantized cache, against plain attention over the same tokens.

Two references per dtype. Over the *stored* K/V (what the cache holds, dequantized) the
paged path must be exact: prefill chunks, the step's own tokens, batched decodes and
consecutive blocks read in place all see the same values. Over the *original* float K/V
it is off by what quantization costs, and the tolerance is that cost's bound, computed from
the data: a value error moves an output by at most ``max |dV|``, and a key error ``dK``
moves each score by at most ``E = scale * max_j sum_d |q_d dK_jd|``, so every softmax weight
by a factor within ``e^(+-2E)``, and the output by at most ``(e^(2E) - 1) * max |V|``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from testkit.attend import attend

from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.kv_quant import dequantize, quantize
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

H, HKV, D, BS = 8, 2, 64, 4  # GQA: 4 query heads per KV head; SmolLM2's head size
DTYPES = [torch.int8, torch.float8_e4m3fn]
# The bound above is the worst case, every rounding error aligned with the query: with an
# 8x outlier key channel it allows an output to move by 2-3.5, vacuous at unit scale. The
# errors are independent roundings instead, and largely cancel: the largest output error
# over these 18 sequences is 0.136 for int8 and 0.138 for fp8. They are alike because the
# outlier sets int8's step: a key row with amax ~24 rounds every channel to steps of
# 24 / 127 = 0.19, as coarse as fp8's 2^-4 relative rounding of values near 1.5. The limit
# 0.2 leaves 1.5x room; a cache read at the wrong scale or not dequantized misses by 10x.
TYPICAL_ERROR = {torch.int8: 0.2, torch.float8_e4m3fn: 0.2}


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a whole sequence [T, H, D]."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return o.transpose(0, 1)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(quantize(x, dtype), torch.float32)


def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per query token [T], the most quantizing K and V can move its output (see above)."""
    dk, dv = (stored(k, dtype) - k).abs(), (stored(v, dtype) - v).abs()
    group = H // HKV
    qg = q.abs().view(len(q), HKV, group, D)  # [T, Hkv, g, D]
    # E_t = scale * max over heads and keys j <= t of sum_d |q_td| |dK_jd|
    per_key = torch.einsum("thgd,jhd->thgj", qg, dk) * D**-0.5
    causal_mask = torch.ones(len(q), len(q), dtype=torch.bool).tril()
    e = per_key.masked_fill(~causal_mask[:, None, None, :], 0).amax(dim=(1, 2, 3))
    return dv.max() + (torch.exp(2 * e) - 1) * v.abs().max()


def sequences(lens: list[int], seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lens:
        k = torch.randn(n, HKV, D, generator=gen)
        k[..., 3] *= 8  # an outlier channel, as real keys have
        out.append((torch.randn(n, H, D, generator=gen), k, torch.randn(n, HKV, D, generator=gen)))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
def test_chunks_and_ragged_decodes_read_exactly_what_the_cache_stores(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    lens = [3 + (13 * i) % 57 for i in range(18)]  # 3..59 tokens, ragged
    num_blocks = 256
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lens]
    tables[0] = list(range(200, 200 + -(-lens[0] // BS)))  # consecutive: read in place
    seqs = sequences(lens, seed=1)
    shape = kv_cache_shape(num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV, head_dim=D,
                           dtype=dtype)  # fmt: skip
    cache = torch.zeros(shape, dtype=dtype)
    outs: list[list[torch.Tensor]] = [[] for _ in lens]

    def step(parts: list[tuple[int, int, int]]) -> None:
        """One step: sequence i's tokens [a, b)."""
        meta = AttentionMetadata.build(
            query_lens=[b - a for _, a, b in parts],
            context_lens=[b for _, _, b in parts],
            block_tables=[tables[i] for i, _, _ in parts],
            block_size=BS,
        )
        q, k, v = (torch.cat([seqs[i][x][a:b] for i, a, b in parts]) for x in range(3))
        o = attend(q, k, v, cache, meta, D**-0.5)
        row = 0
        for i, a, b in parts:
            outs[i].append(o[row : row + b - a])
            row += b - a

    # A first chunk of each (no context: the step's own K/V), a second over that context,
    # then every sequence decodes its last token in one step (three length groups).
    step([(i, 0, (n - 1) // 2) for i, n in enumerate(lens) if (n - 1) // 2 > 0])
    step([(i, (n - 1) // 2, n - 1) for i, n in enumerate(lens)])
    step([(i, n - 1, n) for i, n in enumerate(lens)])

    worst = {"stored": 0.0, "original": 0.0}
    for i, (q, k, v) in enumerate(seqs):
        got = torch.cat(outs[i])
        exact = causal(q, stored(k, dtype), stored(v, dtype))
        torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
        err = (got - causal(q, k, v)).abs().amax(dim=(1, 2))
        assert (err <= bound(q, k, v, dtype) + 2e-5).all(), i
        worst["stored"] = max(worst["stored"], (got - exact).abs().max().item())
        worst["original"] = max(worst["original"], err.max().item())
    # Quantization does cost something (the test would pass on a float cache otherwise).
    assert worst["original"] > 100 * worst["stored"]
    assert worst["original"] < TYPICAL_ERROR[dtype]
