"""A whole plan from its inputs: memory, step times, one replica's limits, the fleet. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvflow.cli.plan.capacity import LoadModel, load_model
from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.disagg import DisaggPlan, decode_only_tpot, disagg_plan
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.fleet import FleetPlan, ReplicaPlan, fleet_plan, replica_plan
from kvflow.cli.plan.memory import MemoryPlan, memory_plan
from kvflow.cli.plan.models import ModelSpec
from kvflow.cli.plan.steps import StepModel, from_profile, roofline
from kvflow.cli.plan.workload import Slo, Target, Workload
from kvflow.engine_worker.sim.profiles import SimProfile

_TP_CHOICES = (2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    model: ModelSpec
    work: Workload
    dep: Deployment
    target: Target = field(default_factory=Target)
    slo: Slo = field(default_factory=Slo)
    profile: SimProfile | None = None  # step times from a profile instead of the roofline
    profile_label: str = ""  # its name or path, for the report
    disaggregated: bool = False  # also size separate prefill and decode pools
    kv_link_bytes_per_s: float = 25e9  # prefill -> decode KV transfer, per replica


@dataclass(frozen=True, slots=True)
class Interference:
    """When the TPOT SLO binds a colocated replica: what the prompts' prefill costs it."""

    batch: int  # the colocated SLO batch
    step_s: float  # a colocated step at that batch
    prefill_share_s: float  # of which the prompts' prefill
    decode_only_batch: int  # the largest batch whose prompt-free decode step meets TPOT


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    memory: MemoryPlan
    steps: StepModel
    replica: ReplicaPlan
    fleet: FleetPlan
    interference: Interference | None = None  # the SLO binds and prefill is why
    disagg: DisaggPlan | None = None  # with --disaggregated


def step_model(inputs: PlanInputs) -> StepModel:
    if inputs.profile is not None:
        return from_profile(inputs.profile, inputs.model, inputs.dep, inputs.profile_label)
    # Attention charged at the mean prompt's average context (half its tokens): what
    # prefill costs in throughput; a longer prompt's TTFT is corrected in StepModel.
    return roofline(inputs.model, inputs.dep, inputs.work.mean_input_tokens / 2)


def make_plan(inputs: PlanInputs) -> Plan:
    model, work, dep = inputs.model, inputs.work, inputs.dep
    if model.max_context_tokens is not None and work.max_context_tokens > model.max_context_tokens:
        raise PlanError(
            f"the mix's longest request needs {work.max_context_tokens} tokens of context but "
            f"{model.name} takes at most {model.max_context_tokens}: shorten the input or "
            "output lengths"
        )
    memory = memory_plan(model, work, dep)
    steps = step_model(inputs)
    load = load_model(steps, work)
    limits = {"memory": memory.max_concurrency, "throughput": dep.max_num_seqs}
    slo_batch = load.slo_batch(inputs.slo)
    if slo_batch is not None:
        if slo_batch < 1:
            raise PlanError(_slo_unreachable(inputs, load))
        limits["slo"] = math.floor(min(slo_batch, 1e9))
    replica = replica_plan(load, limits)
    fleet = fleet_plan(
        load,
        replica,
        inputs.target,
        tp=dep.tp,
        redundancy_replicas=dep.redundancy_replicas,
        mean_input_tokens=work.mean_input_tokens,
        price_per_gpu_hour=dep.gpu.price_per_gpu_hour,
    )
    disagg = None
    if inputs.disaggregated:
        disagg = disagg_plan(
            steps,
            work,
            memory,
            inputs.slo,
            inputs.target,
            tp=dep.tp,
            max_num_seqs=dep.max_num_seqs,
            kv_link_bytes_per_s=inputs.kv_link_bytes_per_s,
            price_per_gpu_hour=dep.gpu.price_per_gpu_hour,
        )
    interference = _interference(inputs, steps, load, replica)
    return Plan(inputs, memory, steps, replica, fleet, interference, disagg)


def _interference(
    inputs: PlanInputs, steps: StepModel, load: LoadModel, replica: ReplicaPlan
) -> Interference | None:
    """The TPOT SLO binds and a prompt-free decode step would allow a larger batch."""
    tpot_slo = inputs.slo.tpot_s
    if tpot_slo is None or replica.binding != "slo":
        return None
    decode_only = decode_only_tpot(steps, inputs.work)
    batch = replica.max_batch
    ttft_slo = inputs.slo.ttft_s
    if ttft_slo is not None and load.tpot.max_batch_within(tpot_slo) > min(
        t.max_batch_within(ttft_slo) for t in load.ttft_by_class
    ):
        return None  # TTFT binds, not TPOT: prefill sharing the steps is not the cause
    decode_only_batch = math.floor(min(decode_only.max_batch_within(tpot_slo), 1e9))
    if decode_only_batch <= batch:
        return None
    step_s = load.tpot.at(batch)
    return Interference(batch, step_s, step_s - decode_only.at(batch), decode_only_batch)


def _slo_unreachable(inputs: PlanInputs, load: LoadModel) -> str:
    """Which SLO one request alone already misses, and what would meet it."""
    slo, dep = inputs.slo, inputs.dep
    missed = []
    if slo.tpot_s is not None and load.tpot.at(1) > slo.tpot_s:
        missed.append(
            f"TPOT {slo.tpot_s * 1e3:g} ms (one decode step at batch 1 takes "
            f"{load.tpot.at(1) * 1e3:.2f} ms)"
        )
    if slo.ttft_s is not None and max(t.at(1) for t in load.ttft_by_class) > slo.ttft_s:
        missed.append(
            f"TTFT {slo.ttft_s * 1e3:g} ms (the longest prompt, "
            f"{inputs.work.max_input_tokens} tokens, takes "
            f"{max(t.at(1) for t in load.ttft_by_class) * 1e3:.1f} ms alone)"
        )
    text = f"no batch meets the SLO on {dep.tp} x {dep.gpu_name}: {' and '.join(missed)}."
    if inputs.profile is not None:
        return f"{text} Relax the SLO, or plan a faster GPU or more GPUs per replica."
    for tp in (n for n in _TP_CHOICES if n > dep.tp):
        wider = replace(inputs, dep=replace(dep, tp=tp))
        batch = load_model(step_model(wider), inputs.work).slo_batch(slo)
        if batch is not None and batch >= 1:
            return f"{text} Use --tp {tp} (it meets the SLO), a faster GPU, or relax the SLO."
    return f"{text} No tensor parallelism up to 16 meets it: relax the SLO or use a faster GPU."
