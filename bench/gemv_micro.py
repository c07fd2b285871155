"""A bf16 decode step's products alone: kvflow's GEMV (model/gemv_bf16.c) against torch's
bf16 linear and against the GEMV built without its prefetches, beside a streamed bandwidth
measured in the same run.

Each pass multiplies every weight matrix of a model's decode step once, in the step's
order (QKV, O, gate/up and down of every layer, then the LM head), with random bf16
weights of the model's shapes: SmolLM2-135M (the built-in model, 0.6-57 MB matrices) and
Llama-3.2-1B (``llama3-1b``, 8-525 MB). The arms interleave over rounds in one process;
each reports its median pass and the weights' bytes a second. Needs AVX512-BF16.

    python bench/gemv_micro.py --json FILE            # about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from roofline_stream import last_level_cache_bytes, stream_bandwidth

from kvflow.engine_worker.model import dense_gemv

# (rows, columns) of each product of one layer, then the LM head's, and the layer count.
MODELS: dict[str, tuple[list[tuple[int, int]], tuple[int, int], int]] = {
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], (49152, 576), 30),
    "llama3-1b": ([(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], (128256, 2048), 16),
}
NO_PREFETCH = ("-DPF_ROWS=0",)


def arms(weights: list[torch.Tensor], rows: int) -> dict[str, Callable[[], None]]:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).bfloat16() for w in weights}

    def torch_linear() -> None:
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    def kernel(flags: tuple[str, ...]) -> Callable[[], None]:
        def run() -> None:
            for w in weights:
                dense_gemv.linear(inputs[w.shape[1]], w, extra_flags=flags)

        return run

    return {"torch": torch_linear, "kvflow": kernel(()), "no_prefetch": kernel(NO_PREFETCH)}


def measure(model: str, rows: int, rounds: int) -> dict[str, object]:
    layer, head, layers = MODELS[model]
    torch.manual_seed(0)
    weights = [(torch.randn(r, c) * c**-0.5).bfloat16() for r, c in layer * layers + [head]]
    weight_bytes = sum(w.numel() * 2 for w in weights)
    passes = arms(weights, rows)
    times: dict[str, list[float]] = {name: [] for name in passes}
    for fn in passes.values():
        fn()  # warm: builds, page faults
    for _ in range(rounds):
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "model": model,
        "rows": rows,
        "weight_bytes": weight_bytes,
        **{f"{name}_ms": v for name, v in ms.items()},
        **{f"{name}_gb_s": weight_bytes / v / 1e6 for name, v in ms.items()},
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,llama3-1b")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not dense_gemv.available():
        raise SystemExit("kvflow's bf16 GEMV does not run here (it needs AVX512-BF16 and cc)")
    stream = stream_bandwidth(4 * last_level_cache_bytes(), 5)
    print(f"streamed: {stream['bandwidth_gb_s']:.1f} GB/s ({torch.get_num_threads()} threads)")
    print("\n| model | rows | torch ms (GB/s) | kvflow ms (GB/s) | no prefetch ms (GB/s) | "
          "kvflow, % of streamed | torch / kvflow | no prefetch / kvflow |\n"
          + "|---" * 8 + "|")  # fmt: skip
    results = []
    for model in args.models.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            r = measure(model, rows, args.rounds)
            results.append(r)
            cells = " | ".join(f"{r[f'{a}_ms']:.2f} ({r[f'{a}_gb_s']:.1f})"
                               for a in ("torch", "kvflow", "no_prefetch"))  # fmt: skip
            pct = 100 * r["kvflow_gb_s"] / stream["bandwidth_gb_s"]  # type: ignore[operator]
            print(
                f"| {model} | {rows} | {cells} | {pct:.0f} | "
                f"{r['torch_ms'] / r['kvflow_ms']:.2f} | "  # type: ignore[operator]
                f"{r['no_prefetch_ms'] / r['kvflow_ms']:.2f} |"
            )  # type: ignore[operator]
    if args.json:
        report = {"machine": platform.processor() or platform.machine(),
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                  "stream": stream, "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
