"""One engine step's time: the linear model the simulator, the gateway's router, the operator's
planner and `kvflow plan` all price steps with.

    step_s = base_step_s
           + per_prefill_token_s * num_prefill_tokens
           + per_decode_seq_s    * num_decode_seqs
           + per_kv_token_s      * num_kv_tokens_read
           + per_prefill_seq_s   * num_prefill_seqs

Each term is one physical cost: the weights every step reads (base), the matmul FLOPs of a
prompt token (compute-bound on a GPU), a decoding sequence's share of sampling and matmuls,
and the KV that attention reads (memory-bound while decoding). Profiles set the
coefficients (the engine's ``sim/profiles.py`` from a datasheet, ``sim/fit.py`` from the
real engine; ``kvflow plan``'s roofline from the model and the GPU).

``StepTiming.legacy`` keeps the simulated worker's original flags exact: their model was
``base + per_token * batched_tokens + per_seq * num_seqs``, and a decoding sequence
computes one token, so it is per_token + per_seq per decode, per_token per prefill token
and per_seq per prefill sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def decode_step_s(self, num_seqs: int, context_tokens: float) -> float:
        """A step of ``num_seqs`` decoding sequences with ``context_tokens`` of KV each."""
        return self.base_step_s + num_seqs * (
            self.per_decode_seq_s + self.per_kv_token_s * context_tokens
        )
