"""How many replicas and GPUs a target load needs, and what a million tokens costs.

Each constraint caps a replica's batch; the load then needs ``ceil(load / capacity at that
batch)`` replicas, and the plan takes the largest count plus the spares:

- memory:     the KV cache holds ``max_concurrency`` requests;
- throughput: the engine runs at most ``max_num_seqs``, which caps its tokens per second;
- slo:        the largest batch whose TPOT and TTFT meet the SLOs.

A concurrency target needs ``ceil(N / batch)``; a rate target ``ceil(R / rate(batch))``.
Cost per million output tokens = GPUs x price per GPU-hour / (output tokens/s x 3600) x 1e6,
at the target load (spares are paid for and serve nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.cli.plan.capacity import LoadModel
from kvflow.cli.plan.workload import Target


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """One replica at its largest allowed batch."""

    batch_limits: dict[str, int]  # constraint -> largest batch it allows
    max_batch: int
    binding: str  # the constraint with the smallest batch
    tpot_s: float
    ttft_s: float  # the mix's longest prompt
    requests_per_s: float
    output_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class FleetPlan:
    replicas_by_constraint: dict[str, int]
    replicas_for_load: int
    redundancy_replicas: int
    num_replicas: int
    num_gpus: int
    batch_per_replica: float  # at the target load
    tpot_s: float  # at the target load
    ttft_s: float
    output_tokens_per_s: float  # the whole fleet, at the target load
    total_tokens_per_s: float  # input + output
    cost_per_hour: float | None  # USD, None: no price
    cost_per_million_output_tokens: float | None
    cost_per_million_tokens: float | None  # input + output


def replica_plan(load: LoadModel, batch_limits: dict[str, int]) -> ReplicaPlan:
    binding = min(batch_limits, key=lambda name: batch_limits[name])
    batch = batch_limits[binding]
    return ReplicaPlan(
        batch_limits=batch_limits,
        max_batch=batch,
        binding=binding,
        tpot_s=load.tpot.at(batch),
        ttft_s=load.ttft_longest.at(batch),
        requests_per_s=load.rate_per_s(batch),
        output_tokens_per_s=load.output_tokens_per_s(batch),
    )


def fleet_plan(
    load: LoadModel,
    replica: ReplicaPlan,
    target: Target,
    *,
    tp: int,
    redundancy_replicas: int,
    mean_input_tokens: float,
    price_per_gpu_hour: float | None,
) -> FleetPlan:
    limits = replica.batch_limits
    if target.concurrency is not None:
        need = {k: math.ceil(target.concurrency / b) for k, b in limits.items()}
    elif target.rate_per_s is not None:
        rate = target.rate_per_s
        need = {k: math.ceil(rate / load.rate_per_s(b) - 1e-9) for k, b in limits.items()}
    else:
        need = dict.fromkeys(limits, 1)  # no target: what one replica does at its limit
    replicas = max(need.values())
    if target.concurrency is not None:
        batch = target.concurrency / replicas
    elif target.rate_per_s is not None:
        batch = load.batch_at_rate(target.rate_per_s / replicas)
    else:
        batch = replica.max_batch
    output_tok_s = replicas * load.output_tokens_per_s(batch)
    total_tok_s = (
        output_tok_s * (mean_input_tokens + load.mean_output_tokens) / (load.mean_output_tokens)
    )
    num_replicas = replicas + redundancy_replicas
    num_gpus = num_replicas * tp
    cost_per_hour = None if price_per_gpu_hour is None else num_gpus * price_per_gpu_hour
    return FleetPlan(
        replicas_by_constraint=need,
        replicas_for_load=replicas,
        redundancy_replicas=redundancy_replicas,
        num_replicas=num_replicas,
        num_gpus=num_gpus,
        batch_per_replica=batch,
        tpot_s=load.tpot.at(batch),
        ttft_s=load.ttft_longest.at(batch),
        output_tokens_per_s=output_tok_s,
        total_tokens_per_s=total_tok_s,
        cost_per_hour=cost_per_hour,
        cost_per_million_output_tokens=_per_million(cost_per_hour, output_tok_s),
        cost_per_million_tokens=_per_million(cost_per_hour, total_tok_s),
    )


def _per_million(cost_per_hour: float | None, tokens_per_s: float) -> float | None:
    if cost_per_hour is None:
        return None
    return cost_per_hour / (tokens_per_s * 3600) * 1e6
