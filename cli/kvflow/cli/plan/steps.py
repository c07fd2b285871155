"""Step times of one replica: a roofline from the datasheet, or a measured/simulated profile.

Both are the simulator's linear ``StepTiming`` (``engine_worker/sim/timing.py``)::

    step_s = base_step_s + per_prefill_token_s x prefill tokens
           + per_decode_seq_s x decoding sequences + per_kv_token_s x KV tokens read

The roofline's coefficients, as in ``engine_worker/sim/profiles.py`` but with the plan's
precisions (int4 weights halve what a step reads against fp8):

    base_step_s         = matmul weights x weight bytes / (bandwidth x efficiency) + overhead
    per_prefill_token_s = (2 x matmul params + attention FLOPs) / (peak FLOPS x MFU)
    per_decode_seq_s    = 2 x matmul params / (peak FLOPS x MFU) + per-sequence overhead
    per_kv_token_s      = KV bytes per token / (bandwidth x efficiency)

with bandwidth and FLOPS x tp x the tensor-parallel efficiency. Compute is counted at the
dense bf16 peak whatever the weights' precision (fp8 matmuls would be up to 2x faster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.models import ModelSpec
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.proto.step_model import StepTiming


@dataclass(frozen=True, slots=True)
class StepModel:
    timing: StepTiming
    max_num_batched_tokens: int  # a longer prompt prefills in chunks, one per step
    # Attention's share of a prompt token grows with the tokens before it; the timing
    # charges it at ``ref_context_tokens``, and this corrects a prompt of another length
    # (seconds per prompt token per token of context). 0 for a profile: measured in.
    attention_s_per_token_context: float
    ref_context_tokens: float
    source: str  # "roofline: ..." or "profile ...", said in the report
    is_measured: bool  # a profile (fitted or simulated), not the planner's own roofline

    def prefill_chunks(self, input_tokens: int) -> int:
        return math.ceil(input_tokens / self.max_num_batched_tokens)

    def prefill_work_s(self, input_tokens: int) -> float:
        """A prompt's compute, without the steps' fixed cost (shared with the batch)."""
        per_token = self.timing.per_prefill_token_s + self.attention_s_per_token_context * (
            input_tokens / 2 - self.ref_context_tokens
        )
        chunks = self.prefill_chunks(input_tokens)
        return input_tokens * per_token + chunks * self.timing.per_prefill_seq_s

    def prefill_s(self, input_tokens: int) -> float:
        """A prompt alone: each chunk is a step with its fixed cost."""
        chunks = self.prefill_chunks(input_tokens)
        return chunks * self.timing.base_step_s + self.prefill_work_s(input_tokens)


def roofline(model: ModelSpec, dep: Deployment, ref_context_tokens: float) -> StepModel:
    """The module docstring's arithmetic; attention charged at ``ref_context_tokens``."""
    bytes_per_s = dep.gpu.spec.hbm_bytes_per_s * dep.eff.memory * dep.tp_scale
    flops_per_s = dep.gpu.spec.peak_bf16_flops * dep.eff.compute * dep.tp_scale
    attention_flops_per_context = model.attention_flops_per_token(1)
    timing = StepTiming(
        base_step_s=model.num_matmul_params * dep.weight_bytes_per_param / bytes_per_s
        + dep.eff.step_overhead_s,
        per_prefill_token_s=(
            model.matmul_flops_per_token + attention_flops_per_context * ref_context_tokens
        )
        / flops_per_s,
        per_decode_seq_s=model.matmul_flops_per_token / flops_per_s + dep.eff.per_seq_overhead_s,
        per_kv_token_s=model.kv_bytes_per_token(dep.kv_bytes_per_value) / bytes_per_s,
    )
    return StepModel(
        timing=timing,
        max_num_batched_tokens=dep.max_num_batched_tokens,
        attention_s_per_token_context=attention_flops_per_context / flops_per_s,
        ref_context_tokens=ref_context_tokens,
        source=(
            f"roofline: {dep.tp} x {dep.gpu_name} at {dep.eff.memory:.0%} of "
            f"{dep.gpu.spec.hbm_bytes_per_s / 1e12:.2f} TB/s and {dep.eff.compute:.0%} of "
            f"{dep.gpu.spec.peak_bf16_flops / 1e12:.0f} TFLOPS"
            + (f", {dep.eff.tensor_parallel:.0%} kept over {dep.tp} GPUs" if dep.tp > 1 else "")
        ),
        is_measured=False,
    )


def from_profile(profile: SimProfile, model: ModelSpec, dep: Deployment, label: str) -> StepModel:
    """A profile's step times; refused when it was made for another KV shape."""
    profile_kv = profile.kv_bytes_per_block / profile.block_size
    model_kv = model.kv_bytes_per_token(dep.kv_bytes_per_value)
    if abs(profile_kv - model_kv) > 0.5:
        raise PlanError(
            f"profile {label!r} holds {profile_kv:,.0f} bytes of KV per token but "
            f"{model.name} with {dep.kv_dtype} KV has {model_kv:,.0f}: it was made for another "
            "model; pass the matching --model, or drop --profile to use the roofline"
        )
    return StepModel(
        timing=profile.timing,
        max_num_batched_tokens=dep.max_num_batched_tokens,
        attention_s_per_token_context=0.0,
        ref_context_tokens=0.0,
        source=f"profile {label}: {profile.source}",
        is_measured=True,
    )


def bandwidth_floor_step_s(
    model: ModelSpec, dep: Deployment, batch: float, context_tokens: float
) -> float:
    """A decode step that only streams bytes at the datasheet's bandwidth: the weights once
    and ``batch`` requests' whole context of KV. No engine beats it; the rule of thumb of the
    sizing guides (divide by the bandwidth efficiency for what an engine reaches). Tensor
    parallelism's all-reduces are not counted."""
    read_bytes = model.num_matmul_params * dep.weight_bytes_per_param + (
        batch * context_tokens * model.kv_bytes_per_token(dep.kv_bytes_per_value)
    )
    return read_bytes / (dep.tp * dep.gpu.spec.hbm_bytes_per_s)


def compute_floor_prefill_s(model: ModelSpec, dep: Deployment, input_tokens: int) -> float:
    """A prompt's matmul FLOPs (2 x params per token) at ``--mfu`` of the dense bf16 peak of
    ``tp`` GPUs: the guides' prefill estimate (attention and all-reduces not counted)."""
    flops = model.matmul_flops_per_token * input_tokens
    return flops / (dep.tp * dep.gpu.spec.peak_bf16_flops * dep.eff.compute)
