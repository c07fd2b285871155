"""A batch-64 decode step over ragged contexts: the decode workspace attended in runs of
slots sorted by length against one run padded to the longest context.

The built-in SmolLM2-135M (widened to ``--dtype``, as bench/engine_roofline.py loads it)
decodes ``--batch`` sequences whose contexts are spread evenly over ``--min-len`` ..
``--max-len`` tokens, each step through the model's forward with the engine's own
``DecodeWorkspace`` and ``AttentionMetadata``, the K/V cache holding random values. Arms,
interleaved ``--runs`` times, each on a fresh workspace:

- **one-run**: every slot padded to the step's longest context (``MAX_GROUPS = 1``, no
  sorting): how the workspace attended before it had runs;
- **runs**: up to ``MAX_GROUPS`` runs, each padded to its own longest, slots sorted by length.

The first steps of an arm fill the workspace and sort it (not timed); the median of the
timed steps is reported, with the tokens each arm's attention reads per layer.

    python bench/decode_ragged.py                  # bf16, batch 64, 64..512 tokens
    python bench/decode_ragged.py --dtype float32 --steps 8
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from kvflow.engine_worker.model import decode_workspace
from kvflow.engine_worker.model.attention import compute_dtype
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_workspace import Decode, DecodeWorkspace
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

BLOCK_SIZE = 16


def run_arm(
    model: torch.nn.Module,
    *,
    lens: list[int],
    dtype: torch.dtype,
    steps: int,
    warmup: int,
    grouped: bool,
) -> tuple[list[float], int]:
    """Step times (s) of ``steps`` timed decode steps, and tokens attended per layer in the
    last one."""
    config = model.config
    head_dim = config.head_dim
    num_kv = config.num_key_value_heads
    total = steps + warmup
    blocks_per_seq = -(-(max(lens) + total) // BLOCK_SIZE)
    num_blocks = len(lens) * blocks_per_seq
    shape = kv_cache_shape(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, num_kv_heads=num_kv, head_dim=head_dim
    )
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(config.num_hidden_layers)]
    pool = list(range(num_blocks))
    random.Random(0).shuffle(pool)  # scattered blocks, as a busy pool hands them out
    tables = [pool[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(len(lens))]
    ws = DecodeWorkspace(
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        block_size=BLOCK_SIZE,
        dtype=compute_dtype(dtype, torch.device("cpu")),
        device=torch.device("cpu"),
        max_bytes=8 << 30,
    )
    saved = decode_workspace.MAX_GROUPS, decode_workspace.SORT_GAIN
    if not grouped:
        decode_workspace.MAX_GROUPS, decode_workspace.SORT_GAIN = 1, float("inf")
    times: list[float] = []
    attended = 0
    try:
        for step in range(total):
            ctx = [n + step for n in lens]
            decodes = [
                Decode(f"r{i}", i, c, tables[i], max(lens) + total) for i, c in enumerate(ctx)
            ]
            start = time.perf_counter()
            plan = ws.plan(decodes, all_rows=True)
            assert plan is not None
            meta = AttentionMetadata.build(
                query_lens=[1] * len(ctx),
                context_lens=ctx,
                block_tables=tables,
                block_size=BLOCK_SIZE,
                workspace=plan,
            )
            ids = torch.randint(0, config.vocab_size, (len(ctx),), generator=gen)
            positions = torch.tensor([c - 1 for c in ctx])
            with torch.inference_mode():
                model(ids, positions, caches, meta)
            if step >= warmup:
                times.append(time.perf_counter() - start)
            attended = sum((g.stop - g.start) * g.num_tokens for g in plan.groups)
    finally:
        decode_workspace.MAX_GROUPS, decode_workspace.SORT_GAIN = saved
    return times, attended


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per arm and run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(None, dtype=dtype, quantization="none")
    rnd = random.Random(1)
    span = args.max_len - args.min_len
    lens = [args.min_len + span * i // max(args.batch - 1, 1) for i in range(args.batch)]
    rnd.shuffle(lens)  # arrival order is not length order
    real = sum(lens)
    print(
        f"SmolLM2-135M {args.dtype}, batch {args.batch}, contexts {args.min_len}..{args.max_len}"
        f" ({real} tokens), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    results: dict[str, list[float]] = {"one-run": [], "runs": []}
    attended: dict[str, int] = {}
    for _ in range(args.runs):
        for arm, medians in results.items():
            times, tokens = run_arm(
                model,
                lens=lens,
                dtype=dtype,
                steps=args.steps,
                warmup=args.warmup,
                grouped=arm == "runs",
            )
            medians.append(statistics.median(times))
            attended[arm] = tokens
    print("| arm | step ms: median of runs | least disturbed run | each run | tokens/layer |")
    print("|---|---|---|---|---|")
    for arm, medians in results.items():
        cells = ", ".join(f"{1e3 * m:.1f}" for m in medians)
        ratio = attended[arm] / (real + args.batch * (args.warmup + args.steps - 1))
        print(
            f"| {arm} | {1e3 * statistics.median(medians):.1f} | {1e3 * min(medians):.1f} |"
            f" {cells} | {attended[arm]} ({ratio:.2f}x real) |"
        )
    for name, pick in (("median", statistics.median), ("least disturbed", min)):
        ratio = pick(results["runs"]) / pick(results["one-run"])
        print(f"runs / one-run step time ({name}): {ratio:.3f}")
    # Run by run: the arms of one run are neighbours in time, so they share its noise.
    pairs = [a / b for a, b in zip(results["runs"], results["one-run"], strict=True)]
    print("per run: " + ", ".join(f"{r:.3f}" for r in pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
