"""What one small torch op costs warm, after a GEMM, and after a 16 MB copy.

At batch 1 a decode step streams the model's weights through the caches once: between two
GEMMs, each norm, RoPE or activation op finds its code and data evicted. This prints the
median cost of a few such ops on a SmolLM2-sized row (576 floats) in three states: warm
(run back to back), right after a 3072 x 576 GEMM (7 MB of weights), and right after
copying 16 MB. Why DecoderLayer (model/llama.py) counts ops, not FLOPs.

    python bench/cold_op_cost.py        # about 20 seconds
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN = 576
EPS = 1e-5


def median_us(before: Callable[[], object], op: Callable[[], object], n: int = 400) -> float:
    times = []
    for _ in range(n):
        before()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    x = torch.randn(1, HIDDEN)
    w = torch.randn(HIDDEN)
    eps = torch.tensor(EPS)
    weight = torch.randn(3072, HIDDEN)
    src = torch.randn(4_000_000)
    dst = torch.empty_like(src)

    def vector_norm_rms() -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return (x * torch.addcmul(eps, norm, norm, value=1 / HIDDEN).rsqrt_()).mul_(w)

    ops: dict[str, Callable[[], object]] = {
        "add": lambda: x + x,
        "silu": lambda: F.silu(x),
        "F.rms_norm": lambda: F.rms_norm(x, (HIDDEN,), w, EPS),
        "rms by vector_norm": vector_norm_rms,
    }
    states: dict[str, Callable[[], object]] = {
        "warm": lambda: None,
        "after a GEMM": lambda: F.linear(x, weight),
        "after a 16 MB copy": lambda: dst.copy_(src),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median us per op\n")
    print("| op | " + " | ".join(states) + " |")
    print("|---|" + "---|" * len(states))
    with torch.inference_mode():
        for name, op in ops.items():
            cells = [f"{median_us(before, op):.1f}" for before in states.values()]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
