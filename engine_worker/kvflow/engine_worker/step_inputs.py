"""A step as the model sees it: which tokens of which sequences, where their KV lives.

The scheduler's output holds whole requests (their every token, their sampling settings);
a forward pass needs far less, and under tensor parallelism the ranks that follow rank 0
have no requests at all: rank 0 sends them this record each step (``tp/plan.py``) and
every rank runs the same forward from it. Plain data, built in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence's share of a step: ``new_token_ids`` at positions
    ``[num_computed_tokens, num_computed_tokens + len(new_token_ids))``."""

    request_id: str
    new_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    samples: bool  # its last new token's logits are sampled
    final_len: int  # the context it reaches if it runs to max_tokens (the decode workspace)

    @property
    def num_new_tokens(self) -> int:
        return len(self.new_token_ids)


@dataclass(frozen=True, slots=True)
class StepInputs:
    seqs: list[SeqStep]
    preempted: list[str]  # requests whose blocks were freed since the last step


def step_inputs(output: SchedulerOutput) -> StepInputs:
    seqs = []
    for s in output.scheduled:
        start = s.num_computed_tokens
        seqs.append(
            SeqStep(
                request_id=s.request.request_id,
                new_token_ids=s.request.token_ids[start : start + s.num_new_tokens],
                num_computed_tokens=start,
                block_ids=s.block_ids,
                samples=s.samples,
                final_len=final_len(s.request),
            )
        )
    return StepInputs(seqs, [r.request_id for r in output.preempted])


def final_len(request: Request) -> int:
    """The context a request reaches if it runs to max_tokens (its current one if unbounded)."""
    if request.sampling.max_tokens is None:
        return request.num_tokens
    return request.num_prompt_tokens + request.sampling.max_tokens
