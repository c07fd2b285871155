"""How long one engine step takes in a simulated worker: the shared linear step model
(``kvflow.proto.step_model``) applied to what the scheduler put in the step."""

from __future__ import annotations

from typing import Protocol

from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.proto.step_model import StepShape, StepTiming

__all__ = ["StepShape", "StepTimer", "StepTiming", "TimedSteps", "step_shape"]


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


class TimedSteps:
    """A ``StepTimer`` from a ``StepTiming``: an empty step takes no time."""

    def __init__(self, timing: StepTiming) -> None:
        self.timing = timing

    def step_s(self, output: SchedulerOutput) -> float:
        return self.timing.shape_s(step_shape(output)) if output.scheduled else 0.0
