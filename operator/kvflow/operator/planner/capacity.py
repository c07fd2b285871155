"""A replica's SLO capacity from a step-time profile (pure arithmetic, no I/O).

A simulated worker's profile (docs/simulator.md) prices an engine step linearly:

    step_s = base + per_prefill_token x prefill tokens + per_decode_seq x decoding seqs
           + per_kv_token x KV tokens read + per_prefill_seq x prefill seqs

The operator cannot import the engine worker (components stay apart), so the five
coefficients come in as a `StepTiming`; `kvflow plan` and the benchmark fill one from a
`SimProfile.timing`.

Decode: n sequences decoding with an average context of L = input + output / 2 tokens make
a step of base + n x (per_decode_seq + per_kv_token x L), and every step is one output
token each, so TPOT <= target holds up to n = (target - base) / (per_decode_seq +
per_kv_token x L), and no further than the KV cache (tokens / L) or max_num_seqs allow;
the replica then generates n / step(n) tokens/s. For h100-llama3-8b (6.6 ms base,
30.3 us/seq, 48.9 ns/token) at L = 1,152 and a 50 ms TPOT: (50 - 6.6) / (30.3 + 56.3) us =
501 -> capped at max_num_seqs 256, a 28.8 ms step: 8.9 k tokens/s.

Prefill: a prefill replica prefills at most B / step(B) tokens/s with full B-token chunks (B =
max_num_batched_tokens). A colocated replica runs its prompts' chunks inside the steps it
runs for decode anyway: the base step is paid once per step, and the decode capacity
(n / step(n)) already counts it, so its prompt tokens cost only their own work,
1 / (per_prefill_token + per_kv_token + per_prefill_seq / input) tokens/s. Counting the
base in both (as this module did) made a replica's shares add to more than its busy time:
at the planner benchmark's mix (h200x2-llama3-70b, 256 in / 64 out) the prompt share was
7.6 % too large, 3.85 shares at 40 requests/s where one step-time budget per replica says
3.73 (3.65 at 100 % busy; the simulator holds 10.4 requests/s per replica at 95 %
attainment, 3.85 replicas' worth).

Prompts arrive at random, so a queue forms well before that throughput: a prompt's wait
W in an M/D/1 queue at utilisation rho, with service s = input / throughput, has the
heavy-traffic tail P(W > t) ~= rho x exp(-2 (1 - rho) t / (rho s)) (Kingman;
deterministic service). The largest rho with P(W > ttft - alone) <= 1 - p/100,
`alone` being one mean prompt's own prefill, times the throughput is the capacity. For
h100-llama3-8b, 1k-token prompts, TTFT 1 s at p90: throughput 35.8 k tokens/s, alone
34.4 ms, rho 0.95 (the cap) -> 34.0 k tokens/s; TTFT 200 ms at p99: rho 0.73 -> 26.1 k.
"""

from __future__ import annotations

import math

from kvflow.operator.planner.types import CapacityProfile
from kvflow.proto.step_model import StepTiming

# Never plan a queue above 95 % busy: past it the wait's variance swamps any forecast.
MAX_PREFILL_UTILIZATION = 0.95


def decode_seqs_within_tpot(
    cost: StepTiming,
    *,
    context_tokens: float,
    tpot_target_s: float,
    max_num_seqs: int,
    kv_capacity_tokens: int,
) -> int:
    """Most sequences one replica decodes at once with every step within the TPOT target."""
    if cost.base_step_s >= tpot_target_s:
        raise ValueError(
            f"an empty step takes {cost.base_step_s * 1e3:.1f} ms, over the TPOT target "
            f"{tpot_target_s * 1e3:.1f} ms: no batch meets it; raise tpotTargetMs or use "
            "faster GPUs (more tensor parallelism)"
        )
    per_seq_s = cost.per_decode_seq_s + cost.per_kv_token_s * context_tokens
    by_tpot = math.inf if per_seq_s <= 0 else (tpot_target_s - cost.base_step_s) / per_seq_s
    by_kv = kv_capacity_tokens / max(context_tokens, 1.0)
    return max(0, math.floor(min(by_tpot, by_kv, max_num_seqs)))


def decode_step_s(cost: StepTiming, num_seqs: int, context_tokens: float) -> float:
    """A step of `num_seqs` decoding sequences: each makes one output token."""
    return cost.decode_step_s(num_seqs, context_tokens)


def prefill_tokens_per_s(cost: StepTiming, *, input_tokens: float, chunk_tokens: int) -> float:
    """Prompt tokens/s of back-to-back full chunks of `chunk_tokens`."""
    seqs_per_chunk = max(1.0, chunk_tokens / max(input_tokens, 1.0))
    step_s = (
        cost.base_step_s
        + cost.per_prefill_token_s * chunk_tokens
        + cost.per_kv_token_s * chunk_tokens
        + cost.per_prefill_seq_s * seqs_per_chunk
    )
    return chunk_tokens / step_s


def marginal_prefill_tokens_per_s(cost: StepTiming, *, input_tokens: float) -> float:
    """Prompt tokens/s a colocated replica adds to steps it runs anyway (no base step)."""
    per_token_s = (
        cost.per_prefill_token_s
        + cost.per_kv_token_s
        + cost.per_prefill_seq_s / max(input_tokens, 1.0)
    )
    return math.inf if per_token_s <= 0 else 1.0 / per_token_s


def prompt_alone_s(cost: StepTiming, *, input_tokens: float, chunk_tokens: int) -> float:
    """One mean prompt's prefill on an idle replica (its chunks back to back)."""
    num_chunks = max(1, math.ceil(input_tokens / chunk_tokens))
    return num_chunks * (cost.base_step_s + cost.per_prefill_seq_s) + input_tokens * (
        cost.per_prefill_token_s + cost.per_kv_token_s
    )


def max_queue_utilization(*, service_s: float, wait_budget_s: float, tail: float) -> float:
    """Largest rho with P(wait > wait_budget_s) <= tail (bisection on the module's formula)."""
    lo, hi = 0.0, MAX_PREFILL_UTILIZATION
    if _wait_tail(hi, service_s, wait_budget_s) <= tail:
        return hi
    for _ in range(60):  # 2^-60 of the interval: far below any figure worth printing
        mid = (lo + hi) / 2
        if _wait_tail(mid, service_s, wait_budget_s) <= tail:
            lo = mid
        else:
            hi = mid
    return lo


def _wait_tail(rho: float, service_s: float, wait_s: float) -> float:
    if rho <= 0:
        return 0.0
    return rho * math.exp(-2 * (1 - rho) * wait_s / (rho * service_s))


def capacity_from_timing(
    cost: StepTiming,
    *,
    mean_input_tokens: float,
    mean_output_tokens: float,
    ttft_target_s: float,
    tpot_target_s: float,
    percentile: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    kv_capacity_tokens: int,
    source: str = "",
    colocated: bool = False,
) -> CapacityProfile:
    """A replica's SLO capacity for a traffic mix (the module docstring's arithmetic).

    `colocated`: the replica both prefills and decodes (role colocated), so its prompt
    capacity is the marginal one (no base step); False: a prefill or decode replica of a
    disaggregated pool, whose prefill steps pay the base themselves.
    """
    if mean_input_tokens <= 0 or mean_output_tokens <= 0:
        raise ValueError("mean input and output tokens must be > 0")
    throughput = prefill_tokens_per_s(
        cost, input_tokens=mean_input_tokens, chunk_tokens=max_num_batched_tokens
    )
    alone_s = prompt_alone_s(
        cost, input_tokens=mean_input_tokens, chunk_tokens=max_num_batched_tokens
    )
    if alone_s >= ttft_target_s:
        raise ValueError(
            f"a {mean_input_tokens:.0f}-token prompt alone takes {alone_s * 1e3:.0f} ms to "
            f"prefill, over the TTFT target {ttft_target_s * 1e3:.0f} ms; raise ttftTargetMs "
            "or use faster GPUs"
        )
    rho = max_queue_utilization(
        service_s=mean_input_tokens / throughput,
        wait_budget_s=ttft_target_s - alone_s,
        tail=1 - percentile / 100,
    )
    context_tokens = mean_input_tokens + mean_output_tokens / 2
    seqs = decode_seqs_within_tpot(
        cost,
        context_tokens=context_tokens,
        tpot_target_s=tpot_target_s,
        max_num_seqs=max_num_seqs,
        kv_capacity_tokens=kv_capacity_tokens,
    )
    if seqs < 1:
        raise ValueError(
            f"not one {mean_input_tokens + mean_output_tokens:.0f}-token sequence fits the "
            "KV cache; use more GPUs per replica or shorter requests"
        )
    # The queue's utilisation bound stays the one whole chunks set: a prompt waits for the
    # steps ahead of it either way; only what each prompt token costs differs.
    prompt_tokens_per_s = (
        marginal_prefill_tokens_per_s(cost, input_tokens=mean_input_tokens)
        if colocated
        else throughput
    )
    return CapacityProfile(
        max_prompt_tokens_per_s=rho * prompt_tokens_per_s,
        max_decode_tokens_per_s=seqs / decode_step_s(cost, seqs, context_tokens),
        source=source or "step-time profile",
    )
