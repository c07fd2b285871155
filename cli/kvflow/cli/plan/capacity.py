"""What one replica serves at a given batch: step time, TTFT, request rate; the SLO batch.

A colocated engine with chunked prefill runs ``B`` requests per step. In steady state a
request leaves every ``mean output`` steps per slot and a new prompt joins, so each step
also carries ``B x mean input / mean output`` prompt tokens. Every latency is then linear
in ``B``:

    tpot(B)   = base + B x (decode_seq + kv_token x context read + prefill work / mean output)
    ttft_n(B) = tpot(B)                          (the step in flight when the request lands)
              + prefill_s(n)                     (its chunks, each a step of its own)
              + chunks(n) x B x decode_cost      (the batch's decodes ride in those steps)
    rate(B)   = B / (mean ttft(B) + mean output x tpot(B))         (Little's law)

so the largest batch that meets an SLO is a division, not a search. Queueing before
admission is not modelled: a plan sized to these limits runs replicas at or under them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.cli.plan.steps import StepModel
from kvflow.cli.plan.workload import LengthClass, Slo, Workload


@dataclass(frozen=True, slots=True)
class Linear:
    """``at(B) = base_s + per_seq_s x B``."""

    base_s: float
    per_seq_s: float

    def at(self, batch: float) -> float:
        return self.base_s + self.per_seq_s * batch

    def max_batch_within(self, limit_s: float) -> float:
        """The largest batch with ``at(batch) <= limit_s`` (below 1: none)."""
        if self.per_seq_s <= 0:
            return math.inf if self.base_s <= limit_s else 0.0
        return (limit_s - self.base_s) / self.per_seq_s


@dataclass(frozen=True, slots=True)
class LoadModel:
    tpot: Linear
    ttft_longest: Linear  # the longest prompt of the mix, which an SLO must cover
    ttft_by_class: tuple[Linear, ...]
    duration: Linear  # a mean request's time in the engine, ttft + output x tpot
    mean_output_tokens: float

    def rate_per_s(self, batch: float) -> float:
        return batch / self.duration.at(batch)

    def output_tokens_per_s(self, batch: float) -> float:
        return self.rate_per_s(batch) * self.mean_output_tokens

    def batch_at_rate(self, rate_per_s: float) -> float:
        """The batch a replica settles at when ``rate_per_s`` requests arrive: B = rate x D(B)."""
        busy = rate_per_s * self.duration.per_seq_s
        assert busy < 1, "the replica cannot keep up with this rate at any batch"
        return rate_per_s * self.duration.base_s / (1 - busy)

    def slo_batch(self, slo: Slo) -> float | None:
        """The largest batch meeting every SLO given (None: no SLO given)."""
        limits = []
        if slo.tpot_s is not None:
            limits.append(self.tpot.max_batch_within(slo.tpot_s))
        if slo.ttft_s is not None:
            limits += [t.max_batch_within(slo.ttft_s) for t in self.ttft_by_class]
        return min(limits) if limits else None


def load_model(steps: StepModel, work: Workload) -> LoadModel:
    timing = steps.timing
    mean_out = work.mean_output_tokens
    decode_cost_s = timing.per_decode_seq_s + timing.per_kv_token_s * work.read_context_tokens
    prefill_per_request_s = sum(
        c.share * steps.prefill_work_s(c.input_tokens) for c in work.classes
    )
    tpot = Linear(timing.base_step_s, decode_cost_s + prefill_per_request_s / mean_out)

    def ttft(c: LengthClass) -> Linear:
        chunks = steps.prefill_chunks(c.input_tokens)
        return Linear(
            tpot.base_s + steps.prefill_s(c.input_tokens),
            tpot.per_seq_s + chunks * decode_cost_s,
        )

    by_class = tuple(ttft(c) for c in work.classes)
    longest = max(range(len(work.classes)), key=lambda i: work.classes[i].input_tokens)
    mean_ttft = Linear(
        sum(c.share * t.base_s for c, t in zip(work.classes, by_class, strict=True)),
        sum(c.share * t.per_seq_s for c, t in zip(work.classes, by_class, strict=True)),
    )
    duration = Linear(
        mean_ttft.base_s + mean_out * tpot.base_s,
        mean_ttft.per_seq_s + mean_out * tpot.per_seq_s,
    )
    return LoadModel(tpot, by_class[longest], by_class, duration, mean_out)
