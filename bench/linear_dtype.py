"""torch's linear in float32 against bf16 over a decode step's products, at batch sizes:
what `--dtype auto` weighs on a CPU (engine_worker/auto_dtype.py).

Each pass multiplies every weight matrix of a model's decode step once (gemv_micro.MODELS:
QKV, O, gate/up and down of every layer, then the LM head), with random weights of the
model's shapes held in each dtype. A CPU with native bf16 (``avx512_bf16``, ``amx_bf16``)
runs bf16 through oneDNN's bf16 kernels; one without emulates it, so bf16 halves the bytes
but not the time. The arms interleave over rounds in one process; each reports its median
pass, and the ratio bf16 / float32 per batch size.

    python bench/linear_dtype.py --models smollm2,llama3-1b --rows 1,64 --json FILE  # 3 minutes
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gemv_micro import MODELS

from kvflow.engine_worker.model.attention import cpu_has_native_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def measure(shapes: list[tuple[int, int]], rows: int, rounds: int) -> dict[str, object]:
    """Median seconds of a pass over ``shapes`` (out, in) in each dtype, ``rows`` rows of x."""
    torch.manual_seed(0)
    passes = {}
    for name, dtype in DTYPES.items():
        weights = [(torch.randn(o, i) * i**-0.5).to(dtype) for o, i in shapes]
        inputs = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
        passes[name] = (weights, inputs)
    times: dict[str, list[float]] = {name: [] for name in passes}
    for round_ in range(rounds + 1):  # round 0 warms (page faults, oneDNN's primitives)
        for name, (weights, inputs) in passes.items():
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            if round_:
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "rows": rows,
        **{f"{name}_ms": v for name, v in ms.items()},
        "bf16_over_float32": ms["bfloat16"] / ms["float32"],
        "times_s": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    native = cpu_has_native_bf16()
    print(f"native bf16: {'yes' if native else 'no'} ({torch.get_num_threads()} threads)")
    print("\n| model | rows | float32 ms | bf16 ms | bf16 / float32 |\n" + "|---" * 5 + "|")
    results = []
    for model in args.models.split(","):
        layer, head, layers = MODELS[model]
        for rows in (int(r) for r in args.rows.split(",")):
            r = {"model": model, **measure(layer * layers + [head], rows, args.rounds)}
            results.append(r)
            print(
                f"| {model} | {rows} | {r['float32_ms']:.2f} | {r['bfloat16_ms']:.2f} | "
                f"{r['bf16_over_float32']:.2f} |"
            )
    if args.json:
        report = {"machine": platform.processor() or platform.machine(),
                  "native_bf16": native, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
