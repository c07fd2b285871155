"""Throughput at batch 8-256: kvflow's engine against transformers' continuous batching.

Both serve the same model (transformers' random weights, copied into ours) on the same GPU
in one process; kvflow twice, as it runs by default and with ``--cuda-graphs``. Per batch
size B, B requests arrive at once, each with its own prompt and output length (uniform in
the plan's ranges, seeded by B), greedy, EOS ignored; an arm's throughput is output tokens
over the wall time until its last request finished. The arms take turns going first. The
batch sizes run in the plan's order (the published points first) until the stage budget
would not hold another round.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from gpu.hf_cb import HfContinuousBatching
from gpu.models import build_hf, engine_config, kvflow_from_hf, make_engine, run_engine
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from gpu.shapes import SHAPES

# kvflow as it runs by default, kvflow with --cuda-graphs, transformers' continuous batching.
ARMS = ["kvflow", "kvflow-graphs", "transformers"]


def workload(batch: int, vocab: int, plan: Plan) -> tuple[list[list[int]], list[int]]:
    tp = plan.throughput
    rng = random.Random(f"{plan.seed}-{batch}")
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*tp.prompt_len_range))]
        for _ in range(batch)
    ]
    return prompts, [rng.randint(*tp.output_len_range) for _ in range(batch)]


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    tp = plan.throughput
    device = plan.device
    is_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    raw = SHAPES[tp.shape]
    config = engine_config(raw, tp.shape)
    rec.set("shape", tp.shape)
    rec.set("dtype", str(dtype).removeprefix("torch."))
    log(f"throughput: building {tp.shape}")
    hf = build_hf(raw, dtype, device, plan.seed)
    model = kvflow_from_hf(hf, config, dtype, device)
    max_len = tp.prompt_len_range[1] + tp.output_len_range[1]
    engine_kw: dict[str, Any] = {
        "dtype": dtype,
        "device": device,
        "kv_cache_gib": tp.kv_cache_gib,
        "max_num_seqs": max(tp.batch_sizes),
        "max_num_batched_tokens": tp.max_num_batched_tokens,
        "max_model_len": max_len + 16,
    }
    built = make_engine(model, config, **engine_kw)
    # The same engine with --cuda-graphs, on the same weights and a cache of its own.
    graphed = make_engine(model, config, cuda_graphs=True, **engine_kw)
    graphs = graphed.runner.graphs
    assert graphs is not None
    rec.set("kvflow_kv_blocks", built.num_blocks)
    cb: HfContinuousBatching | None = None
    with rec.part("transformers_init"):
        started = time.perf_counter()
        cb = HfContinuousBatching(
            hf,
            max_new_tokens=tp.output_len_range[1],
            max_requests=max(tp.batch_sizes),
            max_request_tokens=max_len,
            max_batch_tokens=tp.max_num_batched_tokens,
            is_cuda=is_cuda,
        )
        rec.set(
            "transformers_init", {"wall_s": time.perf_counter() - started, "warmup_s": cb.warmup_s}
        )
    # Warm-up of both arms: kernels, allocator, cuBLAS plans.
    warm_prompts, _ = workload(2, config.vocab_size, plan)
    with rec.part("warmup"):
        run_engine(built.engine, warm_prompts, [4, 4], prefix="w")
        run_engine(graphed.engine, warm_prompts, [4, 4], prefix="w")
        if cb is not None:
            cb.run(warm_prompts, [4, 4], timeout_s=max(deadline.left_s() - 5, 1))

    rows: dict[str, dict[str, Any]] = {}
    longest_pair_s = 0.0
    for i, batch in enumerate(tp.batch_sizes):
        if deadline.left_s() < max(10.0, 2.5 * longest_pair_s):
            rows[str(batch)] = {"skipped": "stage budget would not hold this batch size"}
            rec.set("rows", rows)
            continue
        prompts, lens = workload(batch, config.vocab_size, plan)
        row: dict[str, Any] = {
            "requests": batch,
            "output_tokens": sum(lens),
            "prompt_tokens": sum(map(len, prompts)),
        }
        pair_start = time.monotonic()
        arms = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]  # each arm goes first in turn
        for arm in arms:
            with rec.part(f"{arm}/{batch}"):
                extra: dict[str, Any] = {}
                if arm in ("kvflow", "kvflow-graphs"):
                    engine = built.engine if arm == "kvflow" else graphed.engine
                    captured_s, captures = graphs.capture_s, graphs.captures
                    run = run_engine(engine, prompts, lens, prefix=f"b{batch}-")
                    produced = sum(len(t) for t in run.tokens.values())
                    wall = run.wall_s
                    row[f"{arm}_steps"] = run.num_steps
                    if arm == "kvflow-graphs":
                        # Graphs are captured on the first step of each bucket, once per
                        # process: the steady state a server reaches excludes that time.
                        capture_s = graphs.capture_s - captured_s
                        extra = {
                            "captures": graphs.captures - captures,
                            "capture_s": capture_s,
                            "tokens_per_s_captured": produced / (wall - capture_s),
                        }
                elif cb is not None:
                    wall, produced = cb.run(prompts, lens, timeout_s=max(deadline.left_s() - 2, 1))
                else:
                    continue
                row[arm] = {
                    "wall_s": wall,
                    "output_tokens": produced,
                    "tokens_per_s": produced / wall,
                    **extra,
                }
        if "kvflow" in row and "transformers" in row:
            row["ratio"] = row["kvflow"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        if "kvflow-graphs" in row and "transformers" in row:
            row["ratio_graphs"] = (
                row["kvflow-graphs"]["tokens_per_s_captured"] / row["transformers"]["tokens_per_s"]
            )
        rows[str(batch)] = row
        rec.set("rows", rows)
        longest_pair_s = max(longest_pair_s, time.monotonic() - pair_start)
        log(
            f"throughput B={batch}: "
            + ", ".join(f"{a} {row[a]['tokens_per_s']:.0f} tok/s" for a in ARMS if a in row)
        )
    if cb is not None:
        with rec.part("transformers_stop"):
            cb.close()
