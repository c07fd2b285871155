"""Memory of one replica: weights, KV per token and per request, how many requests fit.

    kv_bytes_per_token = 2 x layers x kv_heads x head_dim x kv bytes      (keys and values)
    kv_pool_bytes      = tp x gpu memory x utilisation - weights - tp x overhead
    max_concurrency    = floor(kv_pool_bytes / (context x kv_bytes_per_token))

``context`` is a request's whole context, input + output: an engine that admits a request
must be able to hold it to the end, or it preempts. The overhead (activations, CUDA graphs,
the NCCL buffers) is per GPU; weights split across the GPUs of a replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.models import DTYPE_BYTES, ModelSpec
from kvflow.cli.plan.workload import Workload

GB = 1e9
_TP_CHOICES = (1, 2, 4, 8, 16)  # a replica's GPUs: attention heads split in powers of two


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    gpu_memory_bytes: float  # tp x the datasheet's memory
    usable_bytes: float  # x gpu memory utilisation
    weight_bytes: float
    overhead_bytes: float
    kv_pool_bytes: float  # what is left for the KV cache
    kv_bytes_per_token: float
    kv_bytes_per_request: float  # held context of an average running request
    kv_capacity_tokens: int
    max_concurrency: int  # requests whose KV fits at once


def weight_bytes(model: ModelSpec, dep: Deployment) -> float:
    return model.num_params * dep.weight_bytes_per_param


def kv_pool_bytes(model: ModelSpec, dep: Deployment) -> float:
    usable = dep.tp * dep.gpu.spec.hbm_bytes * dep.eff.memory_utilization
    return usable - weight_bytes(model, dep) - dep.tp * dep.eff.activation_bytes_per_gpu


def memory_plan(model: ModelSpec, work: Workload, dep: Deployment) -> MemoryPlan:
    kv_per_token = model.kv_bytes_per_token(dep.kv_bytes_per_value)
    pool = kv_pool_bytes(model, dep)
    if pool < work.max_context_tokens * kv_per_token:
        raise PlanError(_does_not_fit(model, work, dep))
    per_request = work.held_context_tokens * kv_per_token
    return MemoryPlan(
        gpu_memory_bytes=dep.tp * dep.gpu.spec.hbm_bytes,
        usable_bytes=dep.tp * dep.gpu.spec.hbm_bytes * dep.eff.memory_utilization,
        weight_bytes=weight_bytes(model, dep),
        overhead_bytes=dep.tp * dep.eff.activation_bytes_per_gpu,
        kv_pool_bytes=pool,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_request=per_request,
        kv_capacity_tokens=int(pool // kv_per_token),
        max_concurrency=math.floor(pool / per_request),
    )


def _fits(model: ModelSpec, work: Workload, dep: Deployment) -> bool:
    need = work.max_context_tokens * model.kv_bytes_per_token(dep.kv_bytes_per_value)
    return kv_pool_bytes(model, dep) >= need


def _does_not_fit(model: ModelSpec, work: Workload, dep: Deployment) -> str:
    """What is missing, and the smallest changes that make it fit."""
    one_request = work.max_context_tokens * model.kv_bytes_per_token(dep.kv_bytes_per_value)
    usable = dep.tp * dep.gpu.spec.hbm_bytes * dep.eff.memory_utilization
    need = weight_bytes(model, dep) + dep.tp * dep.eff.activation_bytes_per_gpu + one_request
    text = (
        f"{model.name} does not fit on {dep.tp} x {dep.gpu_name}: "
        f"{weight_bytes(model, dep) / GB:.1f} GB of weights ({dep.weight_dtype}) + "
        f"{dep.tp * dep.eff.activation_bytes_per_gpu / GB:.1f} GB of overhead + "
        f"{one_request / GB:.2f} GB of KV for one {work.max_context_tokens}-token request "
        f"= {need / GB:.1f} GB, but {dep.eff.memory_utilization:.0%} of "
        f"{dep.tp * dep.gpu.spec.hbm_bytes / GB:.0f} GB is {usable / GB:.1f} GB: "
        f"{(need - usable) / GB:.1f} GB missing."
    )
    fixes = []
    tp = next(
        (n for n in _TP_CHOICES if n > dep.tp and _fits(model, work, replace(dep, tp=n))), None
    )
    if tp is not None:
        fixes.append(f"tensor parallelism over more GPUs (--tp {tp} fits)")
    for dtype in ("fp8", "int4"):
        smaller = replace(dep, weight_dtype=dtype, weight_bytes_per_param=DTYPE_BYTES[dtype])
        if DTYPE_BYTES[dtype] < dep.weight_bytes_per_param and _fits(model, work, smaller):
            fixes.append(
                f"quantized weights (--weight-dtype {dtype}: "
                f"{weight_bytes(model, smaller) / GB:.1f} GB)"
            )
            break
    if not fixes:
        fixes.append("a GPU with more memory, or shorter requests")
    return f"{text} Use {' or '.join(fixes)}."
