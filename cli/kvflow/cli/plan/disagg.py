"""A disaggregated plan: a prefill pool sized by TTFT, a decode pool sized by TPOT. Pure.

Prefill replicas run prompts only. Fed continuously, a step carries a full chunk of
``max_num_batched_tokens`` prompt tokens, so one replica finishes

    mu = 1 / (prefill work of the mean prompt + base step x mean prompt / chunk)

requests per second (``S = 1 / mu`` each). Prompts arrive at random, so they queue: at
utilisation ``rho`` the mean wait is the M/D/1 one, ``rho x S / (2 x (1 - rho))``. The
longest prompt's TTFT is that wait, its own prefill alone and the transfer of its KV to a
decode replica:

    ttft(rho) = wait(rho) + prefill_s(longest) + KV bytes(longest) / link bandwidth

so the highest utilisation that meets the TTFT SLO is a division, and the pool needs
``ceil(rate / (rho_max x mu))`` replicas (without a TTFT SLO, ``rho_max`` = 1).

Decode replicas run no prompts, so a decode step is the colocated step without the
prefill each step carries there:

    tpot(B) = base + B x (decode per sequence + KV read per sequence)

and a request stays ``mean output x tpot(B)``. Memory, ``max_num_seqs`` and the TPOT SLO
cap ``B`` as in the colocated plan; the decode pool needs ``ceil(N / B)`` replicas for N
concurrent streams, or ``ceil(rate / (B / (mean output x tpot(B))))`` for a rate.

A concurrency target sizes decode first (N streams) and hands prefill the rate those
streams produce; a rate target sizes both from it; no target plans one decode replica at
its limit and the prefill replicas that keep it fed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.cli.plan.capacity import Linear
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.memory import MemoryPlan
from kvflow.cli.plan.steps import StepModel
from kvflow.cli.plan.workload import Slo, Target, Workload


@dataclass(frozen=True, slots=True)
class PrefillPool:
    replicas: int
    num_gpus: int
    service_s: float  # a mean prompt's share of a busy replica (1 / requests per second)
    requests_per_s_at_full: float  # one replica, fully busy
    max_utilization: float  # the highest that meets the TTFT SLO (1: no TTFT SLO)
    bound_by: str  # "ttft" or "throughput"
    utilization: float  # at the target
    ttft_s: float  # the longest prompt at the target: wait + prefill + KV transfer
    transfer_s: float  # the longest prompt's KV over the link


@dataclass(frozen=True, slots=True)
class DecodePool:
    replicas: int
    num_gpus: int
    batch_limits: dict[str, int]  # constraint -> largest batch it allows
    max_batch: int
    bound_by: str
    batch_per_replica: float  # at the target
    tpot_s: float  # at the target


@dataclass(frozen=True, slots=True)
class DisaggPlan:
    prefill: PrefillPool
    decode: DecodePool
    requests_per_s: float  # the load both pools carry
    output_tokens_per_s: float
    num_gpus: int
    cost_per_hour: float | None
    cost_per_million_output_tokens: float | None

    @property
    def ratio(self) -> str:
        """The xPyD shape: prefill and decode replicas."""
        return f"{self.prefill.replicas}P{self.decode.replicas}D"


def decode_only_tpot(steps: StepModel, work: Workload) -> Linear:
    """A decode step with no prompt tokens in it."""
    t = steps.timing
    return Linear(t.base_step_s, t.per_decode_seq_s + t.per_kv_token_s * work.read_context_tokens)


def prefill_service_s(steps: StepModel, work: Workload) -> float:
    """A mean prompt's time on a busy prefill replica: full chunks share each step's base."""
    work_s = sum(c.share * steps.prefill_work_s(c.input_tokens) for c in work.classes)
    return work_s + steps.timing.base_step_s * work.mean_input_tokens / steps.max_num_batched_tokens


def mdl_wait_s(utilization: float, service_s: float) -> float:
    """M/D/1 mean wait in the queue (Pollaczek-Khinchine with deterministic service)."""
    if utilization >= 1:
        return math.inf
    return utilization * service_s / (2 * (1 - utilization))


def max_utilization(slack_s: float, service_s: float) -> float:
    """The highest rho with ``mdl_wait_s(rho, S) <= slack_s``: rho = 2 x slack / (S + 2 x slack)."""
    if slack_s <= 0:
        return 0.0
    return 2 * slack_s / (service_s + 2 * slack_s)


def disagg_plan(
    steps: StepModel,
    work: Workload,
    memory: MemoryPlan,
    slo: Slo,
    target: Target,
    *,
    tp: int,
    max_num_seqs: int,
    kv_link_bytes_per_s: float,
    price_per_gpu_hour: float | None,
) -> DisaggPlan:
    tpot = decode_only_tpot(steps, work)
    limits = {"memory": memory.max_concurrency, "throughput": max_num_seqs}
    if slo.tpot_s is not None:
        batch = tpot.max_batch_within(slo.tpot_s)
        if batch < 1:
            raise PlanError(
                f"no decode batch meets TPOT {slo.tpot_s * 1e3:g} ms: one decode step at batch "
                f"1 takes {tpot.at(1) * 1e3:.2f} ms even with no prompts in it; relax the SLO, "
                "or plan more GPUs per replica or a faster GPU"
            )
        limits["slo"] = math.floor(min(batch, 1e9))
    bound_by = min(limits, key=lambda k: limits[k])
    max_batch = limits[bound_by]
    mean_out = work.mean_output_tokens

    def decode_rate(batch: float) -> float:
        return batch / (mean_out * tpot.at(batch))

    if target.concurrency is not None:
        decode_replicas = math.ceil(target.concurrency / max_batch)
        batch = target.concurrency / decode_replicas
        rate = decode_replicas * decode_rate(batch)
    elif target.rate_per_s is not None:
        rate = target.rate_per_s
        decode_replicas = math.ceil(rate / decode_rate(max_batch) - 1e-9)
        batch = _batch_at_rate(tpot, mean_out, rate / decode_replicas)
    else:
        decode_replicas, batch = 1, float(max_batch)
        rate = decode_rate(batch)

    prefill = _prefill_pool(steps, work, memory, slo, rate, tp, kv_link_bytes_per_s)
    decode = DecodePool(
        replicas=decode_replicas,
        num_gpus=decode_replicas * tp,
        batch_limits=limits,
        max_batch=max_batch,
        bound_by=bound_by,
        batch_per_replica=batch,
        tpot_s=tpot.at(batch),
    )
    num_gpus = prefill.num_gpus + decode.num_gpus
    output_tok_s = rate * mean_out
    cost = None if price_per_gpu_hour is None else num_gpus * price_per_gpu_hour
    return DisaggPlan(
        prefill=prefill,
        decode=decode,
        requests_per_s=rate,
        output_tokens_per_s=output_tok_s,
        num_gpus=num_gpus,
        cost_per_hour=cost,
        cost_per_million_output_tokens=None if cost is None else cost / (output_tok_s * 3600) * 1e6,
    )


def _batch_at_rate(tpot: Linear, mean_out: float, rate_per_s: float) -> float:
    """B with B / (out x tpot(B)) = rate: B = rate x out x base / (1 - rate x out x per_seq)."""
    busy = rate_per_s * mean_out * tpot.per_seq_s
    assert busy < 1, "the decode replica cannot keep up with this rate at any batch"
    return rate_per_s * mean_out * tpot.base_s / (1 - busy)


def _prefill_pool(
    steps: StepModel,
    work: Workload,
    memory: MemoryPlan,
    slo: Slo,
    rate_per_s: float,
    tp: int,
    kv_link_bytes_per_s: float,
) -> PrefillPool:
    service_s = prefill_service_s(steps, work)
    longest = work.max_input_tokens
    transfer_s = longest * memory.kv_bytes_per_token / kv_link_bytes_per_s
    alone_s = steps.prefill_s(longest) + transfer_s
    if slo.ttft_s is None:
        rho_max, bound_by = 1.0, "throughput"
    else:
        if alone_s > slo.ttft_s:
            raise PlanError(
                f"no prefill load meets TTFT {slo.ttft_s * 1e3:g} ms: the longest prompt "
                f"({longest} tokens) takes {steps.prefill_s(longest) * 1e3:.1f} ms to prefill "
                f"and {transfer_s * 1e3:.1f} ms to move its KV, alone; relax the SLO, plan "
                "more GPUs per replica, or a faster KV link (--kv-link-gb-s)"
            )
        rho_max, bound_by = max_utilization(slo.ttft_s - alone_s, service_s), "ttft"
    per_replica = rho_max / service_s
    replicas = max(1, math.ceil(rate_per_s / per_replica - 1e-9))
    utilization = rate_per_s * service_s / replicas
    return PrefillPool(
        replicas=replicas,
        num_gpus=replicas * tp,
        service_s=service_s,
        requests_per_s_at_full=1 / service_s,
        max_utilization=rho_max,
        bound_by=bound_by,
        utilization=utilization,
        ttft_s=mdl_wait_s(utilization, service_s) + alone_s,
        transfer_s=transfer_s,
    )
