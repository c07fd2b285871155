"""Prefill of one long prompt (8K tokens on the GPU) against the bf16 compute roofline.

A prefill multiplies every token by every weight once and attends causally: its FLOPs are
``2 x matmul weights x N`` (the LM head once: only the last position's logits are
computed) plus ``4 x layers x heads x head_dim x N(N+1)/2`` for QK^T and PV. MFU is those
FLOPs over the time to the first token, over the datasheet's dense bf16 peak (989 TFLOPS
on an H200); the report also puts it against the matrix rate the env stage measured. The
guides assume 40 %; issue 34's target is 50 %.

Per shape (Llama-3-8B and the 70B layer slice): the Engine, one request of ``prompt_len``
tokens and one output token, prefilled in chunks of ``max_num_batched_tokens``, prefix
caching off; a warm-up prefill of other tokens first, then the best of two.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from gpu.models import BLOCK_SIZE, engine_config, free_cuda, kvflow_random, make_engine, run_engine
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from gpu.roofline import model_shape
from gpu.shapes import SHAPES
from kvflow.engine_worker.sim.hardware import H200_SXM, ModelShape

REPS = 2


def prefill_flops(shape: ModelShape, n: int) -> dict[str, float]:
    """FLOPs of one prefill of ``n`` tokens: matrices (LM head for the last token only) and
    causal attention."""
    lm_head = shape.vocab_size * shape.hidden_size
    matmul = 2 * (shape.num_matmul_params - lm_head) * n + 2 * lm_head
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * n * (n + 1) / 2
    return {"matmul": float(matmul), "attention": float(attention), "total": matmul + attention}


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    p = plan.prefill
    device = plan.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rec.set("dtype", str(dtype).removeprefix("torch."))
    rec.set("prompt_len", p.prompt_len)
    rec.set("peak_flops_datasheet", {"gpu": H200_SXM.name, "flops": H200_SXM.peak_bf16_flops})
    results: dict[str, Any] = {}
    for name in p.shapes:
        if deadline.left_s() < 10:
            results[name] = {"skipped": "stage budget spent"}
            rec.set("shapes", results)
            continue
        with rec.part(name):
            shape = model_shape(name, dtype.itemsize)
            config = engine_config(SHAPES[name], name)
            log(f"prefill: building {name}")
            model = kvflow_random(config, dtype, device, plan.seed)
            max_len = p.prompt_len + BLOCK_SIZE
            built = make_engine(
                model,
                config,
                dtype=dtype,
                device=device,
                num_blocks=-(-max_len // BLOCK_SIZE) + 4,
                max_num_seqs=1,
                max_num_batched_tokens=p.max_num_batched_tokens,
                max_model_len=max_len,
                enable_prefix_caching=False,
            )
            rng = random.Random(plan.seed)
            best = float("inf")
            for rep in range(REPS + 1):  # the first is the warm-up
                prompt = [rng.randrange(3, config.vocab_size) for _ in range(p.prompt_len)]
                run = run_engine(built.engine, [prompt], [1], prefix=f"p{rep}-")
                if rep:
                    best = min(best, run.wall_s)
            flops = prefill_flops(shape, p.prompt_len)
            results[name] = {
                "params_b": shape.num_params / 1e9,
                "steps": run.num_steps,
                "ttft_s": best,
                "prompt_tokens_per_s": p.prompt_len / best,
                "flops": flops,
                "achieved_flops": flops["total"] / best,
                "mfu_datasheet": flops["total"] / best / H200_SXM.peak_bf16_flops,
            }
            rec.set("shapes", results)
            log(
                f"prefill {name}: {p.prompt_len} tokens in {best:.3f} s, "
                f"MFU {results[name]['mfu_datasheet']:.0%} of the datasheet bf16 peak"
            )
        built = model = None  # type: ignore[assignment]
        free_cuda(device)
