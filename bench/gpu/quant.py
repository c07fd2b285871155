"""The scale issue's FP8 arms on the 8B shape: FP8 weights, an FP8 KV cache, both.

Each arm serves the same random weights (transformers' draw, copied by the engine's own
loader; ``fp8`` weights quantized per output row as they load, quant/fp8_weight.py):
  batch-1 decode   tokens/s, eager engine, against the HBM roofline of the bytes that arm
                   actually reads per step (its weights as stored, less the embedding
                   table, plus its KV at the mean context)
  batch B          ``batch`` requests at once, output tokens/s
  accuracy         the prefill logits of the longest prompt against the baseline arm's
                   (bf16 weights and cache: mean absolute difference over the logits'
                   spread) and the greedy tokens' leading agreement with it
On a CPU the same code runs in float32 (torch's CPU ``_scaled_mm`` computes FP8 products).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from gpu.models import (
    BLOCK_SIZE,
    build_hf,
    engine_config,
    free_cuda,
    kvflow_from_hf,
    make_engine,
    run_engine,
)
from gpu.parity import leading_agreement, prefill_logits
from gpu.plan import Plan
from gpu.record import Deadline, Recorder, log
from gpu.shapes import SHAPES
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.weights import load_weights
from kvflow.engine_worker.sim.hardware import H200_SXM

FP8 = torch.float8_e4m3fn
# (arm, FP8 weights, FP8 KV cache)
ARMS = (("baseline", False, False), ("fp8_weights", True, False), ("fp8_kv", False, True),
        ("fp8_both", True, True))  # fmt: skip


def step_weight_bytes(model: Any) -> int:
    """Bytes of the weights as stored (FP8 codes and their scales included), less the
    embedding table, of which a step reads a row per token."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    embed = model.embed_tokens.weight
    return int(total - embed.numel() * embed.element_size())


def run(plan: Plan, rec: Recorder, deadline: Deadline) -> None:
    q = plan.quant
    device = plan.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    raw = SHAPES[q.shape]
    config = engine_config(raw, q.shape)
    rec.set("shape", q.shape)
    rec.set("dtype", str(dtype).removeprefix("torch."))
    log(f"quant: building {q.shape} (bf16 and FP8 weights)")
    hf = build_hf(raw, dtype, device, plan.seed)
    models = {False: kvflow_from_hf(hf, config, dtype, device)}
    with rec.part("fp8_load"):
        fp8 = LlamaForCausalLM(config, dtype=dtype, device=device)
        load_weights(fp8, hf.state_dict(), source=f"transformers {q.shape}", fp8=True)
        models[True] = fp8.eval().requires_grad_(False)
    hf = None
    free_cuda(device)
    rng = random.Random(plan.seed)
    prompt = [rng.randrange(3, config.vocab_size) for _ in range(q.prompt_len)]
    batch_prompts = [
        [rng.randrange(3, config.vocab_size) for _ in range(q.prompt_len)] for _ in range(q.batch)
    ]
    max_len = q.prompt_len + max(q.new_tokens, q.batch_new_tokens) + BLOCK_SIZE
    per_seq = -(-max_len // BLOCK_SIZE)
    mean_context = q.prompt_len + q.new_tokens / 2
    arms: dict[str, Any] = {}
    reference: dict[str, Any] = {}
    for arm, fp8_weights, fp8_kv in ARMS:
        if deadline.left_s() < 8:
            arms[arm] = {"skipped": "stage budget spent"}
            rec.set("arms", arms)
            continue
        if fp8_weights not in models:
            continue  # the FP8 load failed: recorded under fp8_load
        with rec.part(arm):
            model = models[fp8_weights]
            built = make_engine(
                model,
                config,
                dtype=dtype,
                device=device,
                num_blocks=per_seq * (q.batch + 2),
                max_num_seqs=q.batch,
                max_num_batched_tokens=max(2048, q.prompt_len),
                max_model_len=max_len,
                kv_cache_dtype=FP8 if fp8_kv else None,
            )
            logits = prefill_logits(model, built.runner, prompt, device).float()
            run_engine(built.engine, [batch_prompts[0][: q.prompt_len // 2]], [2], prefix="w")
            one = run_engine(built.engine, [prompt], [q.new_tokens], prefix="one")
            decode_s = one.wall_s - one.step_end_s[0]
            tps = (q.new_tokens - 1) / decode_s
            # KV bytes per token as this arm's cache stores them (a quantized row's scale too).
            caches = built.runner.kv_caches
            cache_bytes = sum(t.numel() * t.element_size() for t in caches)
            kv_token_bytes = cache_bytes / (caches[0].shape[0] * BLOCK_SIZE)
            step_bytes = step_weight_bytes(model) + kv_token_bytes * mean_context
            ceiling = H200_SXM.hbm_bytes_per_s / step_bytes
            many = run_engine(
                built.engine, batch_prompts, [q.batch_new_tokens] * q.batch, prefix="many"
            )
            produced = sum(len(t) for t in many.tokens.values())
            result: dict[str, Any] = {
                "weights": "fp8" if fp8_weights else str(dtype).removeprefix("torch."),
                "kv_cache": "fp8" if fp8_kv else str(dtype).removeprefix("torch."),
                "step_bytes": step_bytes,
                "kv_bytes_per_token": kv_token_bytes,
                "roofline_tokens_per_s": ceiling,
                "decode_tokens_per_s": tps,
                "fraction_of_roofline": tps / ceiling,
                "batch": q.batch,
                "batch_tokens_per_s": produced / many.wall_s,
                "batch_output_tokens": produced,
            }
            if not reference:
                reference = {"logits": logits, "tokens": one.tokens["one0"]}
            spread = float(reference["logits"].std())
            result["logit_mean_abs_diff_vs_baseline"] = float(
                (logits - reference["logits"]).abs().mean()
            )
            result["logit_error_of_spread"] = result["logit_mean_abs_diff_vs_baseline"] / spread
            result["greedy_agree_leading_vs_baseline"] = leading_agreement(
                one.tokens["one0"], reference["tokens"]
            )
            result["new_tokens"] = q.new_tokens
            arms[arm] = result
            rec.set("arms", arms)
            log(
                f"quant {arm}: batch 1 {tps:.1f} tok/s ({tps / ceiling:.0%} of its roofline), "
                f"batch {q.batch} {result['batch_tokens_per_s']:.0f} tok/s"
            )
        built = None  # type: ignore[assignment]
        free_cuda(device)
