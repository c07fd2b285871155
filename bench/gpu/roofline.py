"""Batch-1 decode against the HBM roofline.

A decode step at batch 1 reads every weight once (the embedding table but one row) and the
KV of the context, and does little else: tokens per second cannot exceed
``bandwidth / (weight bytes + KV bytes per token x context)``. For Llama-3-8B in bf16 on an
H200's datasheet 4.8 TB/s that is 15.0 GB + 0.13 MB x context: about 318 tokens/s at a
640-token context. The target (issue 12) is at least 60 % of it.

Four measurements of the same decode, to say where the rest goes:
  engine     the Engine, one request (scheduler, metadata, model, sampler: what a user gets)
  engine_graphs  the same with --cuda-graphs: decode steps replayed from CUDA graphs
  forward    our model's decode forward alone, eager, metadata built once
  graph      that forward captured once in a CUDA graph and replayed (the launch overhead
             gone): the what-if of issue 12's "CUDA graphs for decode batches"
plus transformers' ``generate`` at batch 1 on the same shape, for reference.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from gpu.models import (
    BLOCK_SIZE,
    build_hf,
    engine_config,
    free_cuda,
    kvflow_random,
    make_engine,
    run_engine,
    sync,
)
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from gpu.shapes import SHAPES
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.sim.hardware import H200_SXM, ModelShape


def model_shape(name: str, dtype_bytes: int) -> ModelShape:
    raw = SHAPES[name]
    return ModelShape(
        name,
        raw["vocab_size"],
        raw["hidden_size"],
        raw["intermediate_size"],
        raw["num_hidden_layers"],
        raw["num_attention_heads"],
        raw["num_key_value_heads"],
        raw["head_dim"],
        dtype_bytes,
    )


def roofline(shape: ModelShape, context_tokens: float, bytes_per_s: float) -> dict[str, float]:
    """Bytes one batch-1 decode step reads at this mean context, and the tokens/s ceiling."""
    step_bytes = shape.step_weight_bytes + shape.kv_bytes_per_token * context_tokens
    return {
        "weight_bytes_per_step": float(shape.step_weight_bytes),
        "kv_bytes_per_step": float(shape.kv_bytes_per_token * context_tokens),
        "bytes_per_step": float(step_bytes),
        "hbm_bytes_per_s": bytes_per_s,
        "tokens_per_s": bytes_per_s / step_bytes,
    }


def _decode_inputs(config: Any, context_len: int, device: str) -> tuple[Any, ...]:
    """One decode token at position ``context_len - 1`` of a sequence in blocks 0..n-1."""
    blocks = list(range(-(-context_len // BLOCK_SIZE)))
    meta = AttentionMetadata.build(
        query_lens=[1],
        context_lens=[context_len],
        block_tables=[blocks],
        block_size=BLOCK_SIZE,
        device=device,
    )
    ids = torch.tensor([5], dtype=torch.int64, device=device)
    pos = torch.tensor([context_len - 1], dtype=torch.int64, device=device)
    return ids, pos, meta


@torch.inference_mode()
def time_forward(
    model: Any, runner: Any, config: Any, context_len: int, steps: int, device: str, graph: bool
) -> float:
    """Seconds per decode forward (logits included), eager or replayed from a CUDA graph."""
    ids, pos, meta = _decode_inputs(config, context_len, device)

    def forward() -> torch.Tensor:
        return model.compute_logits(model(ids, pos, runner.kv_caches, meta))

    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            forward()
        call = g.replay
    else:
        for _ in range(2):
            forward()
        call = forward  # type: ignore[assignment]
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        call()
    sync(device)
    return (time.perf_counter() - start) / steps


@torch.inference_mode()
def hf_batch1(hf: Any, prompt: list[int], n: int, device: str) -> float:
    """transformers' decode tokens/s at batch 1: (n - 1) tokens over generate(n) - generate(1),
    each the best of two (the prefill and the set-up cancel out)."""
    ids = torch.tensor([prompt], dtype=torch.int64, device=device)
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def gen(k: int) -> float:
        best = float("inf")
        for _ in range(2):
            sync(device)
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)
            sync(device)
            best = min(best, time.perf_counter() - start)
        return best

    gen(2)  # warm-up
    decode_s = gen(n) - gen(1)
    if decode_s <= 0:
        raise RuntimeError(
            f"generate({n}) took no longer than generate(1): timing noise exceeds {n - 1} "
            "decode steps on this machine; raise hf_new_tokens"
        )
    return (n - 1) / decode_s


def engine_decode(
    rec: Recorder,
    model: Any,
    config: Any,
    engine_kw: dict[str, Any],
    prompts: tuple[list[int], list[int]],
    new_tokens: int,
    ceiling: dict[str, float],
    key: str = "",
) -> Any:
    """Batch-1 decode through the Engine as it runs by default (eager), then with
    --cuda-graphs: decode steps replayed from graphs captured on the first step of their
    bucket. The warm-up request (other tokens, the same length) captures the bucket the
    measured decode starts in; a capture inside the measured run is counted in
    ``captures_measured``. Recorded as ``{key}engine`` and ``{key}engine_graphs``; returns
    the last engine built (its runner's cache serves the forward timings)."""
    prompt, warm = prompts
    built = None
    for part, cuda_graphs in (("engine", False), ("engine_graphs", True)):
        with rec.part(key + part):
            built = make_engine(model, config, cuda_graphs=cuda_graphs, **engine_kw)
            run_engine(built.engine, [warm], [2], prefix="warm")
            captures_before = built.runner.graphs.captures if cuda_graphs else 0
            run = run_engine(built.engine, [prompt], [new_tokens])
            decode_s = run.wall_s - run.step_end_s[0]
            steps = [b - a for a, b in zip(run.step_end_s, run.step_end_s[1:], strict=False)]
            tps = (new_tokens - 1) / decode_s
            result = {
                "decode_tokens_per_s": tps,
                "median_step_ms": 1e3 * sorted(steps)[len(steps) // 2],
                "prefill_s": run.step_end_s[0],
                "fraction_of_roofline": tps / ceiling["tokens_per_s"],
                "tokens": run.tokens["r0"],
            }
            graphs = built.runner.graphs
            if graphs is not None:
                result |= {
                    "graph_steps": graphs.steps,
                    "captures": graphs.captures,
                    "captures_measured": graphs.captures - captures_before,
                    "capture_s": graphs.capture_s,
                    "buckets": graphs.buckets,
                }
            rec.set(key + part, result)
            log(
                f"roofline: {key}{part} {tps:.1f} tok/s = {tps / ceiling['tokens_per_s']:.0%} of "
                f"{ceiling['tokens_per_s']:.0f}"
            )
    eager, graphed = rec.data.get(key + "engine"), rec.data.get(key + "engine_graphs")
    if eager and graphed:
        # --cuda-graphs on and off: the same greedy tokens, and which arm is faster.
        rec.set(
            key + "cuda_graphs",
            {
                "tokens_identical": eager["tokens"] == graphed["tokens"],
                "speedup": graphed["decode_tokens_per_s"] / eager["decode_tokens_per_s"],
                "faster": "on"
                if graphed["decode_tokens_per_s"] > eager["decode_tokens_per_s"]
                else "off",
            },
        )
    return built


def _setup(
    name: str, dtype: torch.dtype, p: Any, seed: int, device: str
) -> tuple[Any, Any, dict[str, Any], tuple[list[int], list[int]], dict[str, float], float]:
    shape = model_shape(name, dtype.itemsize)
    config = engine_config(SHAPES[name], name)
    mean_context = p.prompt_len + p.new_tokens / 2
    ceiling = roofline(shape, mean_context, H200_SXM.hbm_bytes_per_s)
    log(f"roofline: building {name} ({shape.num_params / 1e9:.2f} B parameters)")
    model = kvflow_random(config, dtype, device, seed)
    need = -(-(p.prompt_len + p.new_tokens) // BLOCK_SIZE) + 4
    engine_kw: dict[str, Any] = {
        "dtype": dtype,
        "device": device,
        "num_blocks": 2 * need,
        "max_num_seqs": 1,
        "max_num_batched_tokens": max(p.prompt_len, 256),
        "max_model_len": 4096,
    }
    rng = random.Random(seed)
    prompt, warm = (
        [rng.randrange(3, config.vocab_size) for _ in range(p.prompt_len)] for _ in range(2)
    )
    return model, config, engine_kw, (prompt, warm), ceiling, mean_context


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    p = plan.roofline
    device = plan.device
    is_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if is_cuda else torch.float32
    raw = SHAPES[p.shape]
    model, config, engine_kw, prompts, ceiling, mean_context = _setup(
        p.shape, dtype, p, plan.seed, device
    )
    prompt = prompts[0]
    rec.set("shape", p.shape)
    rec.set("dtype", str(dtype).removeprefix("torch."))
    rec.set("roofline_datasheet", {**ceiling, "gpu": H200_SXM.name, "mean_context": mean_context})
    built = engine_decode(rec, model, config, engine_kw, prompts, p.new_tokens, ceiling)
    context = int(mean_context)
    steps_n = p.graph_steps or 10
    with rec.part("forward"):
        s = time_forward(model, built.runner, config, context, steps_n, device, graph=False)
        rec.set(
            "forward",
            {
                "step_ms": s * 1e3,
                "tokens_per_s": 1 / s,
                "fraction_of_roofline": (1 / s) / ceiling["tokens_per_s"],
            },
        )
    if is_cuda and p.graph_steps:
        with rec.part("graph"):
            s = time_forward(model, built.runner, config, context, steps_n, device, graph=True)
            rec.set(
                "graph",
                {
                    "step_ms": s * 1e3,
                    "tokens_per_s": 1 / s,
                    "fraction_of_roofline": (1 / s) / ceiling["tokens_per_s"],
                },
            )
    built = model = None  # type: ignore[assignment]
    free_cuda(device)
    # The other shapes (the 70B layer slice): batch-1 decode, eager and --cuda-graphs.
    extra: dict[str, Any] = {}
    for name in p.extra_shapes:
        if deadline.left_s() < 15:
            extra[name] = {"skipped": "stage budget spent"}
            rec.set("shapes", extra)
            continue
        with rec.part(f"{name}/build"):
            model, config, kw, their_prompts, their_ceiling, mc = _setup(
                name, dtype, p, plan.seed, device
            )
            key = f"{name}/"
            engine_decode(rec, model, config, kw, their_prompts, p.new_tokens, their_ceiling, key)
            moved = {
                k.removeprefix(key): rec.data.pop(k) for k in list(rec.data) if k.startswith(key)
            }
            extra[name] = {
                "roofline_datasheet": {**their_ceiling, "gpu": H200_SXM.name, "mean_context": mc},
                **moved,
            }
            rec.set("shapes", extra)
        model = None
        free_cuda(device)
    if p.hf_new_tokens and deadline.left_s() > 20:
        with rec.part("transformers"):
            hf = build_hf(raw, dtype, device, plan.seed)
            tps = hf_batch1(hf, prompt, p.hf_new_tokens, device)
            rec.set(
                "transformers",
                {"decode_tokens_per_s": tps, "fraction_of_roofline": tps / ceiling["tokens_per_s"]},
            )
            hf = None
