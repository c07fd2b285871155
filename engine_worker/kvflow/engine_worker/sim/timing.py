"""How long one engine step takes in a simulated worker: a linear model of the batch.

    step_s = base_step_s
           + per_prefill_token_s * num_prefill_tokens
           + per_decode_seq_s    * num_decode_seqs
           + per_kv_token_s      * num_kv_tokens_read
           + per_prefill_seq_s   * num_prefill_seqs

Each term is one physical cost: the weights every step reads (base), the matmul FLOPs of a
prompt token (compute-bound on a GPU), a decoding sequence's share of sampling and matmuls,
and the KV that attention reads (memory-bound while decoding). Profiles set the
coefficients (``profiles.py`` from a datasheet, ``fit.py`` from the real engine).

``StepTiming.legacy`` keeps the worker's original flags exact: their model was
``base + per_token * batched_tokens + per_seq * num_seqs``, and a decoding sequence
computes one token, so it is per_token + per_seq per decode, per_token per prefill token
and per_seq per prefill sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvflow.engine_worker.core.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes, in the units the timing model charges."""

    num_prefill_tokens: int  # prompt tokens (and recomputed tokens after a preemption)
    num_prefill_seqs: int
    num_decode_seqs: int  # requests computing the KV of their newest output token
    num_kv_tokens_read: int  # KV attention reads: per request, computed + new tokens

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


def step_shape(output: SchedulerOutput, discount_tokens: dict[str, int] | None = None) -> StepShape:
    """The shape of a scheduled step.

    A request decodes when it computes exactly one token past its prompt; anything else
    (a prompt chunk, the last prompt token after a full cache hit, a recompute after
    preemption) is prefill. ``discount_tokens`` (request id -> leading tokens) marks
    tokens as already computed elsewhere: the virtual cluster's ideal-hit arm charges
    nothing for a prompt's globally cached prefix.
    """
    num_prefill_tokens = num_prefill_seqs = num_decode_seqs = num_kv = 0
    for s in output.scheduled:
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        num_kv += end
        if s.num_new_tokens == 1 and start >= s.request.num_prompt_tokens:
            num_decode_seqs += 1
            continue
        free = discount_tokens.get(s.request.request_id, 0) if discount_tokens else 0
        charged = end - max(start, min(free, end))
        num_prefill_tokens += charged
        num_prefill_seqs += 1
    return StepShape(num_prefill_tokens, num_prefill_seqs, num_decode_seqs, num_kv)


class StepTimer(Protocol):
    def step_s(self, output: SchedulerOutput) -> float:
        """Seconds the step ``output`` takes."""
        ...


@dataclass(frozen=True, slots=True)
class StepTiming:
    base_step_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_kv_token_s: float = 0.0
    per_prefill_seq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise ValueError(f"step timing {name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def legacy(cls, base_step_s: float, per_token_s: float, per_seq_s: float) -> StepTiming:
        """The worker's original three flags, exactly (see the module docstring)."""
        return cls(
            base_step_s=base_step_s,
            per_prefill_token_s=per_token_s,
            per_decode_seq_s=per_token_s + per_seq_s,
            per_prefill_seq_s=per_seq_s,
        )

    @property
    def is_zero(self) -> bool:
        return not any(getattr(self, name) for name in self.__dataclass_fields__)

    def shape_s(self, shape: StepShape) -> float:
        return (
            self.base_step_s
            + self.per_prefill_token_s * shape.num_prefill_tokens
            + self.per_decode_seq_s * shape.num_decode_seqs
            + self.per_kv_token_s * shape.num_kv_tokens_read
            + self.per_prefill_seq_s * shape.num_prefill_seqs
        )

    def step_s(self, output: SchedulerOutput) -> float:
        return self.shape_s(step_shape(output)) if output.scheduled else 0.0
