"""Two costs of a batched decode step on this CPU, warm, each formulation side by side.

- **Greedy sampling**: ``argmax(dim=-1)`` against ``max(dim=-1).indices`` (the same first
  index of a tie) over SmolLM2's 49,152 logits at 1-256 rows.
- **Decode attention at batch 64**: ``scaled_dot_product_attention`` against
  ``matmul``-softmax-``matmul`` over the decode workspace's layout: 64 sequences, 3 KV heads
  with 3 grouped queries each, contexts of 128-155 tokens, head size 64 (one SmolLM2 layer).

- **Decode attention cold**: the same attention as a step meets it, each layer's K/V
  coming from memory after a GEMM, against reading K and V once, in float32 and bfloat16.

- **A graphed step's inputs**: the host's cost of ``--cuda-graphs``' one packed tensor
  against the eager path's attention metadata, at batch 1-256.

- **bfloat16 against float32** (``attention.compute_dtype``): the GEMMs of a decode step at
  batch 64 and 1 (the 56 M model's shapes), and masked decode attention at batch 64 over
  the workspace's layout. On a CPU with AVX512-BF16 the first favours bf16, the second
  float32, which is why a bf16 model attends in float32 on the CPU.

- **What a quantized KV cache costs** (``--kv-cache-dtype``): one SmolLM2 layer's cache
  write (quantize and scatter) and its gather (copy and dequantize) for 64 decodes over
  100-400 tokens and for a 512-token prefill chunk, and a whole decode step of paged
  attention over the gather path, float32 against int8 and fp8, through the engine's own
  ``attention`` functions.

The CPU's paged decode kernel has its own, bench/paged_micro.py.

    python bench/decode_micro.py        # every section, about a minute
    python bench/decode_micro.py kv_dtypes greedy   # only these
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

VOCAB = 49_152


def median_ms(fn: Callable[[], object], n: int, rounds: int = 5) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e3)
    return statistics.median(times)


def greedy() -> None:
    print("| rows | argmax ms | max(...).indices ms | ratio |\n|---|---|---|---|")
    for rows in (1, 8, 64, 256):
        logits = torch.randn(rows, VOCAB)
        assert torch.equal(logits.argmax(dim=-1), logits.max(dim=-1).indices)
        n = max(5, 400 // rows)
        slow = median_ms(lambda x=logits: x.argmax(dim=-1), n)
        fast = median_ms(lambda x=logits: x.max(dim=-1).indices, n)
        print(f"| {rows} | {slow:.3f} | {fast:.3f} | {slow / fast:.1f}x |")


def attention() -> None:
    torch.manual_seed(0)
    batch, kv_heads, group, head_dim, longest, capacity = 64, 3, 3, 64, 155, 512
    wk = torch.randn(batch + 8, kv_heads, capacity, head_dim)
    wv = torch.randn(batch + 8, kv_heads, capacity, head_dim)
    q = torch.randn(batch, kv_heads, group, head_dim)
    lens = torch.randint(128, longest + 1, (batch,))
    mask = (torch.arange(longest)[None, :] < lens[:, None])[:, None, None, :]
    keys, values = wk[:batch, :, :longest], wv[:batch, :, :longest]
    scale = head_dim**-0.5
    bias = torch.zeros(batch, 1, 1, longest).masked_fill_(~mask, float("-inf"))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

    def manual() -> torch.Tensor:
        scores = torch.add(bias, torch.matmul(q, keys.transpose(-1, -2)), alpha=scale)
        return torch.matmul(torch.softmax(scores, dim=-1), values)

    assert torch.allclose(sdpa(), manual(), atol=1e-5)
    problems = batch * kv_heads
    print(f"\n| attention, one layer ({problems} problems) | ms | us per problem |\n|---|---|---|")
    for name, fn in (("sdpa", sdpa), ("matmul-softmax-matmul", manual)):
        ms = median_ms(fn, 50)
        print(f"| {name} | {ms:.3f} | {ms * 1e3 / problems:.1f} |")


COLD_LAYERS = 30


def cold_layer_ms(
    fn: Callable[[torch.Tensor, torch.Tensor], object], kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Median ms per layer of ``fn(k, v)`` over every layer in turn, a GEMM before each."""
    weight, x = torch.randn(2304, 576), torch.randn(64, 576)

    def one_pass() -> float:
        total = 0.0
        for k, v in kv:
            F.linear(x, weight)  # streams 5 MB of weights through the caches
            start = time.perf_counter()
            fn(k, v)
            total += time.perf_counter() - start
        return total / len(kv) * 1e3

    one_pass()  # warm-up
    return statistics.median(one_pass() for _ in range(7))


def cold_attention() -> None:
    """Decode attention as a step meets it: 30 layers' K/V in turn, a GEMM between layers,
    so each layer's context comes from memory. Against reading the same K and V once, and
    in bfloat16."""
    torch.manual_seed(0)
    batch, kv_heads, group, head_dim, tokens = 64, 3, 3, 64, 170
    shape = (batch, kv_heads, tokens, head_dim)
    print(f"\n| cold, per layer ({COLD_LAYERS} layers of {batch} x {kv_heads} x {tokens} tokens) "
          "| ms |\n|---|---|")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        kv = [
            (torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
            for _ in range(COLD_LAYERS)
        ]
        q = torch.randn(batch, kv_heads, group, head_dim, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        sdpa = cold_layer_ms(lambda k, v, q=q: F.scaled_dot_product_attention(q, k, v), kv)
        read = cold_layer_ms(lambda k, v: (k.sum(), v.sum()), kv)
        print(f"| sdpa, {name} | {sdpa:.2f} |\n| read K and V once, {name} | {read:.2f} |")


def graph_inputs() -> None:
    """The host's share of a decode step's inputs: ``--cuda-graphs`` packs them into one
    tensor for one copy (``DecodeGraphs._pack``); the eager path builds its attention
    metadata (``AttentionMetadata.build``: slots, a padded block table, a mask). Both on the
    CPU, for the same step of 16-token blocks; on a GPU the eager path also copies each of
    its tensors to the device, and the graphed one makes one asynchronous copy."""
    from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
    from kvflow.engine_worker.model.decode_graphs import DecodeGraphs, DecodeStep, bucket

    block = 16
    graphs = DecodeGraphs(
        lambda *_: torch.empty(0),
        block_size=block,
        scratch_slot=0,
        max_batch=256,
        max_blocks=256,
        device=torch.device("cpu"),
        capture=False,
    )
    print("\n| decode step | pack ms (graphs) | metadata ms (eager) | ratio |\n|---|---|---|---|")
    for batch, context in ((1, 640), (64, 384), (256, 384), (256, 1000)):
        blocks = -(-context // block)
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
        step = DecodeStep(
            [5] * batch,
            [context - 1] * batch,
            [t[-1] * block + (context - 1) % block for t in tables],
            tables,
            [context - i % 7 for i in range(batch)],  # contexts a little apart: a mask
        )

        def eager(step: DecodeStep = step) -> object:
            return AttentionMetadata.build(
                query_lens=[1] * len(step.token_ids),
                context_lens=step.context_lens,
                block_tables=step.block_tables,
                block_size=block,
            )

        key = (bucket(batch), bucket(blocks))
        pack = median_ms(lambda step=step, key=key: graphs._pack(step, *key), 50)
        meta = median_ms(eager, 50)
        print(f"| {batch} x {context} tokens | {pack:.3f} | {meta:.3f} | {pack / meta:.2f} |")


def dtypes() -> None:
    torch.manual_seed(0)
    print("\n| GEMM (M x K by K x N) | float32 ms | bfloat16 ms | ratio |\n|---|---|---|---|")
    for m, k, n in ((64, 512, 1536), (64, 512, 2752), (64, 1376, 512), (64, 512, 32000),
                    (1, 512, 32000)):  # fmt: skip
        x, w = torch.randn(m, k), torch.randn(n, k)
        xb, wb = x.bfloat16(), w.bfloat16()
        f32 = median_ms(lambda x=x, w=w: F.linear(x, w), 20)
        b16 = median_ms(lambda x=xb, w=wb: F.linear(x, w), 20)
        print(f"| {m} x {k} by {k} x {n} | {f32:.3f} | {b16:.3f} | {f32 / b16:.1f}x |")
    print(
        "\n| decode attention, 64 sequences (KV heads x grouped queries, tokens) "
        "| float32 ms | bfloat16 ms | ratio |\n|---|---|---|---|"
    )
    for kv_heads, group, longest in ((8, 1, 300), (8, 1, 500), (3, 3, 400)):
        batch, head_dim, capacity = 64, 64, 512
        wk = torch.randn(batch, kv_heads, capacity, head_dim)
        wv = torch.randn(batch, kv_heads, capacity, head_dim)
        q = torch.randn(batch, kv_heads, group, head_dim)
        lens = torch.randint(longest // 3, longest + 1, (batch,))
        bias = torch.zeros(batch, longest).masked_fill_(
            torch.arange(longest)[None, :] >= lens[:, None], float("-inf")
        )[:, None, None, :]
        ms = {}
        for dtype in (torch.float32, torch.bfloat16):
            k, v = wk.to(dtype)[:, :, :longest], wv.to(dtype)[:, :, :longest]
            qd, bd = q.to(dtype), bias.to(dtype)
            ms[dtype] = median_ms(
                lambda q=qd, k=k, v=v, b=bd: F.scaled_dot_product_attention(q, k, v, attn_mask=b),
                10,
            )
        f32, b16 = ms[torch.float32], ms[torch.bfloat16]
        print(f"| {kv_heads} x {group}, {longest} | {f32:.2f} | {b16:.2f} | {b16 / f32:.1f}x |")


def kv_dtypes() -> None:
    from kvflow.engine_worker.model.attention import paged_attention
    from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
    from kvflow.engine_worker.model.paged_cache import gather_kv, kv_cache_shape, write_kv

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, batch = 9, 3, 64, 16, 64  # SmolLM2's layer
    num_blocks = 4096
    lens = torch.randint(100, 401, (batch,)).tolist()
    free = torch.randperm(num_blocks).tolist()  # scattered blocks, as after churn
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    longest = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (longest - len(t)) for t in tables])
    meta = AttentionMetadata.build(
        query_lens=[1] * batch, context_lens=lens, block_tables=tables, block_size=block_size
    )
    q = torch.randn(batch, heads, head_dim)
    kv64 = torch.randn(batch, 2, kv_heads, head_dim)
    slots64 = torch.tensor([t[0] * block_size for t in tables])
    kv512 = torch.randn(512, 2, kv_heads, head_dim)
    slots512 = torch.arange(512)
    everything = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim)
    names = (
        "write 64 decode tokens",
        "write a 512-token chunk",
        "gather 64 contexts of 100-400 tokens",
        "decode step, 64 sequences (gather path)",
    )
    columns = []
    for dtype in (torch.float32, torch.int8, torch.float8_e4m3fn):
        shape = kv_cache_shape(num_blocks=num_blocks, block_size=block_size,
                               num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)  # fmt: skip
        c = torch.zeros(shape, dtype=dtype)
        with torch.inference_mode():
            write_kv(c, everything, torch.arange(num_blocks * block_size))  # every slot set
            columns.append(
                [
                    median_ms(lambda c=c: write_kv(c, kv64, slots64), 50),
                    median_ms(lambda c=c: write_kv(c, kv512, slots512), 10),
                    median_ms(lambda c=c: gather_kv(c, padded, longest * 16, torch.float32), 5),
                    median_ms(lambda c=c: paged_attention(q, kv64, c, meta, 0.125), 5),
                ]
            )
    print("\n| one layer, SmolLM2's shape | float32 ms | int8 ms | fp8 ms |\n|---|---|---|---|")
    for name, (f32, i8, f8) in zip(names, zip(*columns, strict=True), strict=True):
        print(f"| {name} | {f32:.3f} | {i8:.3f} ({i8 / f32:.1f}x) | {f8:.3f} ({f8 / f32:.1f}x) |")


SECTIONS: dict[str, Callable[[], None]] = {
    "greedy": greedy,
    "attention": attention,
    "cold_attention": cold_attention,
    "graph_inputs": graph_inputs,
    "dtypes": dtypes,
    "kv_dtypes": kv_dtypes,
}

if __name__ == "__main__":
    for section in sys.argv[1:] or list(SECTIONS):
        SECTIONS[section]()
