"""The CPU's paged decode kernel (model/cpu_paged.c), measured warm on this CPU.

- ``paged``: one SmolLM2 layer's decode attention through the engine's ``paged_attention``,
  the kernel against the decode workspace and the gather path, at batch 1-64 over
  200-2,000 tokens, over float32, int8 and a bf16 model's caches.
- ``paged_builds``: the kernel alone as this CPU builds it against its AVX2-only build and
  one without prefetches.

    python bench/paged_micro.py                      # both sections, about 3 minutes
    python bench/paged_micro.py paged_builds --json FILE   # what they measured, as JSON
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
from collections.abc import Callable

import torch
from decode_micro import median_ms

# What the sections record for --json, by section.
RESULTS: dict[str, object] = {}


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


SECTIONS: dict[str, Callable[[], None]] = {"paged": paged, "paged_builds": paged_builds}

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
