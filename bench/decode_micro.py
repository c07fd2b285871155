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

- **The CPU's paged decode kernel** (``paged``): one layer's decode attention through it
  against the decode workspace and the gather path, at batch 1-64 over 200-2,000 tokens;
  (``paged_builds``) the kernel alone as this CPU builds it against its AVX2-only build and
  one without prefetches.

    python bench/decode_micro.py        # every section, about a minute
    python bench/decode_micro.py kv_dtypes greedy   # only these
    python bench/decode_micro.py paged paged_builds --json FILE   # what they measured, as JSON
"""

from __future__ import annotations

import functools
import math
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


def paged_layer_ms(batch: int, length: int, cache_dtype: str = "float32") -> dict[str, float]:
    """``paged``'s three arms at one batch and context length (ms a layer), over a cache of
    ``cache_dtype`` (float32; int8 rows and their scales; or bfloat16: a bf16 model's, its
    Q and K/V in bf16, attending in ``compute_dtype``: bf16 on a CPU with native bf16)."""
    from kvflow.engine_worker.model.attention import compute_dtype, paged_attention
    from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
    from kvflow.engine_worker.model.decode_workspace import Decode, DecodeWorkspace
    from kvflow.engine_worker.model.kv_quant import kv_cache_dtype, quantize
    from kvflow.engine_worker.model.paged_cache import kv_cache_shape

    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16  # SmolLM2's layer
    model_dtype = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float32
    wide = compute_dtype(model_dtype, torch.device("cpu"))
    dtype = kv_cache_dtype("int8" if cache_dtype == "int8" else "auto", model_dtype)
    lens = [max(1, int(length * (0.75 + 0.5 * torch.rand(()).item()))) for _ in range(batch)]
    num_blocks = sum(-(-(n + 1) // block_size) for n in lens) + 8
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(n + 1) // block_size))] for n in lens]
    shape = kv_cache_shape(num_blocks=num_blocks, block_size=block_size,
                           num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
    cache = torch.randn(shape)
    cache = quantize(cache, dtype) if dtype == torch.int8 else cache.to(dtype)
    q = torch.randn(batch, heads, head_dim, dtype=model_dtype)
    kv = torch.randn(batch, 2, kv_heads, head_dim, dtype=model_dtype)

    def meta(ctx: list[int], **options: object) -> AttentionMetadata:
        return AttentionMetadata.build(
            query_lens=[1] * batch, context_lens=ctx, block_tables=tables,
            block_size=block_size, **options,  # type: ignore[arg-type]
        )  # fmt: skip

    arms = {"paged": meta(lens, paged_kernel=True), "gather": meta(lens, paged_kernel=False)}
    workspace = DecodeWorkspace(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim,
                                block_size=block_size, dtype=wide,
                                device=torch.device("cpu"), max_bytes=1 << 31)  # fmt: skip
    with torch.inference_mode():
        if batch > 1:  # a lone decode never uses the workspace (MIN_DECODES)
            for step in (0, 1):  # the first step fills the slots; the second only appends
                ctx = [n + step for n in lens]
                decodes = [Decode(str(i), i, n, t, n + 64)
                           for i, (n, t) in enumerate(zip(ctx, tables, strict=True))]  # fmt: skip
                arms["workspace"] = meta(ctx, workspace=workspace.plan(decodes, all_rows=True))
                arms["workspace"] = arms["workspace"].layer(0)
                paged_attention(q, kv, cache, arms["workspace"], 0.125)
        calls = max(3, 2000 // (batch * length // 100))
        out = {name: median_ms(lambda m=m: paged_attention(q, kv, cache, m, 0.125), calls)
               for name, m in arms.items()}  # fmt: skip
    return {"workspace": float("nan"), **out}


def paged() -> None:
    """One SmolLM2 layer's decode attention, warm, through the engine's ``paged_attention``:
    the CPU's paged kernel (model/cpu_paged.py) against the decode workspace in its steady
    state (each step appends a token, no fills) and the gather path, over a float32 cache
    and an int8 one (float32 attention) and a bf16 model's (attending in bf16 where the CPU
    has native bf16: then the workspace and the gather run bf16 SDPA, the kernel float32),
    torch's threads (OMP_NUM_THREADS); contexts of the length +- 25 %, on scattered blocks."""
    from kvflow.engine_worker.model.attention import compute_dtype

    torch.manual_seed(0)
    print("\n| cache | attention (SDPA's) | batch | context | paged kernel ms | workspace ms | "
          "gather ms | workspace / paged | gather / paged |\n" + "|---" * 9 + "|")  # fmt: skip
    rows = []
    cases = [("float32", b, n) for b, n in ((1, 200), (1, 2000), (8, 200), (8, 2000), (64, 200),
                                            (64, 1000))]  # fmt: skip
    cases += [("int8", b, n) for b, n in ((1, 2000), (8, 2000), (64, 1000))]
    cases += [("bfloat16", b, n) for b, n in ((1, 200), (1, 2000), (8, 2000), (64, 200),
                                              (64, 1000))]  # fmt: skip
    for cache_dtype, batch, length in cases:
        ms = paged_layer_ms(batch, length, cache_dtype)
        # NaN (no workspace at batch 1) as JSON's null
        times = {f"{k}_ms": None if math.isnan(v) else v for k, v in ms.items()}
        model = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float32
        wide = str(compute_dtype(model, torch.device("cpu"))).removeprefix("torch.")
        rows.append({"cache": cache_dtype, "attention": wide, "batch": batch, "context": length,
                     **times})  # fmt: skip
        RESULTS["paged"] = rows
        print(f"| {cache_dtype} | {wide} | {batch} | {length} | {ms['paged']:.3f} | "
              f"{ms['workspace']:.3f} | "
              f"{ms['gather']:.3f} | {ms['workspace'] / ms['paged']:.2f} | "
              f"{ms['gather'] / ms['paged']:.2f} |")  # fmt: skip


def paged_builds() -> None:
    """The CPU's paged kernel alone (ctypes, no Python around it), as this CPU builds it
    against its AVX2-only build (``-mno-avx512f``: what a CPU without AVX512 runs; on such a
    CPU the same code) and a build that does not prefetch the next tile's rows
    (``-DPAGED_NO_PREFETCH``), all in one process, interleaved over 7 rounds of 10 calls,
    median: per cache dtype, SmolLM2's heads (9 over 3 of 64) and Llama-3-8B's (32 over 8 of
    128), random block tables, torch's threads."""
    from kvflow.engine_worker.model import cpu_paged
    from kvflow.engine_worker.model.kv_quant import QUANTIZED_DTYPES, is_quantized, quantize
    from kvflow.engine_worker.model.paged_cache import kv_cache_shape

    builds = {
        "native": cpu_paged.build_kernel(()),
        "avx2": cpu_paged.build_kernel(("-mno-avx512f",)),
        "no_prefetch": cpu_paged.build_kernel(("-DPAGED_NO_PREFETCH",)),
    }
    if None in builds.values():
        raise SystemExit("no C compiler: the paged kernel does not build")
    torch.manual_seed(0)
    print("\n| cache | batch | context | heads / KV heads x dim | native ms | AVX2-only ms | "
          "no prefetch ms | AVX2-only / native | no prefetch / native |\n"
          + "|---" * 9 + "|")  # fmt: skip
    rows = []
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, **QUANTIZED_DTYPES}
    shapes = [(64, 1000, 9, 3, 64), (8, 2000, 9, 3, 64), (64, 200, 9, 3, 64), (1, 4000, 9, 3, 64),
              (16, 1000, 32, 8, 128)]  # fmt: skip
    block_size = 16
    for name, dtype in dtypes.items():
        for batch, length, heads, kv_heads, head_dim in shapes:
            per = -(-length // block_size)
            num_blocks = batch * per + 2
            shape = kv_cache_shape(num_blocks=num_blocks, block_size=block_size,
                                   num_kv_heads=kv_heads, head_dim=head_dim)  # fmt: skip
            cache = torch.randn(shape)
            cache = quantize(cache, dtype) if is_quantized(dtype) else cache.to(dtype)
            table = torch.randperm(num_blocks)[: batch * per].view(batch, per).contiguous()
            q = torch.randn(batch, heads, head_dim)
            lens = torch.full((batch,), length, dtype=torch.int64)
            out = torch.empty_like(q)
            size = cache.element_size()
            strides = [n * size for n in cache.stride()[:4]]
            threads = torch.get_num_threads()
            args = (q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(), *strides,
                    cpu_paged.KINDS[dtype], table.data_ptr(), table.stride(0), lens.data_ptr(),
                    out.data_ptr(), out.stride(0), out.stride(1), batch, heads, kv_heads,
                    head_dim, block_size, head_dim**-0.5)  # fmt: skip
            times: dict[str, list[float]] = {k: [] for k in builds}
            for _ in range(7):
                for build, kernel in builds.items():
                    assert kernel is not None
                    function, shared = kernel
                    call = functools.partial(function, *args, threads if shared else 1)
                    times[build].append(median_ms(call, 10, rounds=1))
            native, avx2, plain = (statistics.median(times[b]) for b in builds)
            rows.append({"cache": name, "batch": batch, "context": length, "heads": heads,
                         "kv_heads": kv_heads, "head_dim": head_dim, "native_ms": native,
                         "avx2_ms": avx2, "no_prefetch_ms": plain})  # fmt: skip
            RESULTS["paged_builds"] = rows
            print(f"| {name} | {batch} | {length} | {heads} / {kv_heads} x {head_dim} | "
                  f"{native:.3f} | {avx2:.3f} | {plain:.3f} | {avx2 / native:.2f} | "
                  f"{plain / native:.2f} |")  # fmt: skip


SECTIONS: dict[str, Callable[[], None]] = {
    "greedy": greedy,
    "attention": attention,
    "cold_attention": cold_attention,
    "graph_inputs": graph_inputs,
    "dtypes": dtypes,
    "kv_dtypes": kv_dtypes,
    "paged": paged,
    "paged_builds": paged_builds,
}

# What sections record for --json (``paged`` and ``paged_builds`` so far), by section.
RESULTS: dict[str, object] = {}

if __name__ == "__main__":
    args = sys.argv[1:]
    json_path = None
    if "--json" in args:
        at = args.index("--json")
        json_path = args[at + 1]
        del args[at : at + 2]
    for section in args or list(SECTIONS):
        SECTIONS[section]()
    if json_path is not None:
        import json
        import os
        import platform

        report = {"machine": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), **RESULTS}  # fmt: skip
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {json_path}")
