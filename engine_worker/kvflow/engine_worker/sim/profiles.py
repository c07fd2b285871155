"""Simulated-worker profiles: a timing model plus the KV geometry of one GPU x model.

A profile is chosen by name. ``roofline_profile`` derives one from a GPU's datasheet and
a model's shape; ``fit.py`` fits one to the real engine (``kvflow profile``) and
``profile_file.py`` reads and writes either as JSON.

The roofline arithmetic, for H100-SXM x Llama-3-8B (bf16, one GPU):
- base_step_s: every step reads the matmul weights once, 15.0 GB, at 80 % of 3.35 TB/s
  (gpt-fast reached 69 % of an A100's at batch 1; tuned engines 80 %) = 5.6 ms, plus 1 ms
  of scheduling and launches = 6.6 ms. On an H200 (4.8 TB/s): 3.9 + 1 = 4.9 ms.
- per_prefill_token_s: 2 FLOPs per weight (15.0 GFLOP) plus attention against an average
  of 2,048 earlier tokens (4 x 32 layers x 4,096 x 2,048 = 1.07 GFLOP), at 60 % of
  989 TFLOPS (good prefill MFU) = 27.1 us; an 8k-token prompt prefills in about 0.22 s.
- per_decode_seq_s: a decoding sequence multiplies through the same weights, 15.0 GFLOP at
  60 % of peak = 25.3 us, plus 5 us of sampling and bookkeeping = 30.3 us. The linear sum
  overstates a batch near the ridge point (about 240 sequences), where weight reads and
  FLOPs overlap, by at most base_step_s.
- per_kv_token_s: 128 KiB of KV per token (2 x 32 layers x 8 KV heads x 128 x 2 bytes)
  at 80 % of the HBM bandwidth = 48.9 ns; a 4k-token context adds 0.2 ms to a step.
- KV capacity: 90 % of HBM (vLLM's default utilization) less the weights (16.1 GB) and
  2 GB of activations: 53.9 GB on an H100 = 411,523 tokens = 25,720 blocks of 16.
Tensor parallelism over N GPUs multiplies bandwidth, FLOPS and HBM by N and keeps 85 % of
it (all-reduces between layers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvflow.engine_worker.sim.hardware import GPUS, MODELS, GpuSpec, ModelShape
from kvflow.proto.step_model import StepTiming

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Efficiency:
    memory: float = 0.80  # of HBM bandwidth, weight and KV reads
    compute: float = 0.60  # of dense bf16 FLOPS, matmuls
    tensor_parallel: float = 0.85  # kept when the model is split over several GPUs
    step_overhead_s: float = 1.0e-3  # scheduling, launches, sampling setup per step
    per_seq_overhead_s: float = 5e-6  # sampling and bookkeeping per decoding sequence
    # The prompt tokens' average attended context, for prefill's attention FLOPs (the
    # linear model cannot charge them per chunk: they grow with the context).
    prefill_context_tokens: int = 2048
    memory_utilization: float = 0.90  # of HBM the engine takes (vLLM's default)
    activation_bytes_per_gpu: float = 2e9


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    timing: StepTiming
    block_size: int
    kv_bytes_per_block: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_link_bytes_per_s: float  # PD: KV moves between workers at this rate
    source: str  # where the numbers come from, for reports

    def __post_init__(self) -> None:
        if min(self.block_size, self.kv_bytes_per_block, self.num_kv_blocks) < 1:
            raise ValueError(f"profile {self.name}: block size, bytes and count must be >= 1")
        if min(self.max_num_batched_tokens, self.max_num_seqs) < 1:
            raise ValueError(f"profile {self.name}: batch limits must be >= 1")
        if self.kv_link_bytes_per_s <= 0:
            raise ValueError(f"profile {self.name}: kv_link_bytes_per_s must be > 0")

    def transfer_s(self, num_blocks: int) -> float:
        """Seconds to move ``num_blocks`` of KV between two workers (PD)."""
        return num_blocks * self.kv_bytes_per_block / self.kv_link_bytes_per_s


def roofline_timing(gpu: GpuSpec, model: ModelShape, tp: int, eff: Efficiency) -> StepTiming:
    """The module docstring's arithmetic."""
    scale = tp * (eff.tensor_parallel if tp > 1 else 1.0)
    bytes_per_s = gpu.hbm_bytes_per_s * eff.memory * scale
    flops_per_s = gpu.peak_bf16_flops * eff.compute * scale
    prefill_flops = model.matmul_flops_per_token + model.attention_flops_per_token(
        eff.prefill_context_tokens
    )
    return StepTiming(
        base_step_s=model.step_weight_bytes / bytes_per_s + eff.step_overhead_s,
        per_prefill_token_s=prefill_flops / flops_per_s,
        per_decode_seq_s=model.matmul_flops_per_token / flops_per_s + eff.per_seq_overhead_s,
        per_kv_token_s=model.kv_bytes_per_token / bytes_per_s,
    )


def kv_capacity_tokens(gpu: GpuSpec, model: ModelShape, tp: int, eff: Efficiency) -> int:
    usable = tp * (gpu.hbm_bytes * eff.memory_utilization - eff.activation_bytes_per_gpu)
    free = usable - model.weight_bytes
    return int(free // model.kv_bytes_per_token)


def roofline_profile(
    gpu: GpuSpec,
    model: ModelShape,
    *,
    tp: int = 1,
    eff: Efficiency = Efficiency(),
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    name: str | None = None,
) -> SimProfile:
    tokens = kv_capacity_tokens(gpu, model, tp, eff)
    if tokens < max(block_size, max_num_batched_tokens):
        raise ValueError(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB) leaves no room for KV on "
            f"{tp} x {gpu.name}; use more GPUs (e.g. {gpu.name.split('-')[0].lower()}x4-...)"
        )
    return SimProfile(
        name=name or f"{gpu.name}x{tp}-{model.name}",
        timing=roofline_timing(gpu, model, tp, eff),
        block_size=block_size,
        kv_bytes_per_block=model.kv_bytes_per_token * block_size,
        num_kv_blocks=tokens // block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_link_bytes_per_s=gpu.kv_link_bytes_per_s,
        source=f"roofline: {tp} x {gpu.name}, {model.name} bf16, {eff}",
    )


# Shipped: one GPU for the 8B model; the 70B model's 141 GB of weights need 4 H100s or
# 2 H200s. Any <gpu>[x<N>]-<model> whose weights fit is accepted.
SHIPPED = ("h100-llama3-8b", "h200-llama3-8b", "h100x4-llama3-70b", "h200x2-llama3-70b")
_NAME = re.compile(r"^(?P<gpu>[a-z0-9]+?)(?:x(?P<tp>\d+))?-(?P<model>.+)$")


def named_profile(name: str) -> SimProfile | None:
    """The roofline profile ``<gpu>[x<tp>]-<model>`` (e.g. ``h100-llama3-8b``), or None."""
    match = _NAME.match(name)
    if match is None or match["gpu"] not in GPUS or match["model"] not in MODELS:
        return None
    tp = int(match["tp"] or 1)
    if tp < 1:
        return None
    return roofline_profile(GPUS[match["gpu"]], MODELS[match["model"]], tp=tp, name=name)
