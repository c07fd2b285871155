"""When a batch line may start: the one rule the runner (batch/runner.py) and the simulator's
batch day (kvflow.sim.batch_day) share. Pure.

Two conditions, both on the pool's last load reports:

- spare capacity: no worker reports requests waiting. Any queue means online traffic is
  using the capacity, and a line would delay someone's first token;
- TPOT headroom (when an online TPOT target is set): on every worker of the pool, the
  decode step with one more running sequence (the line's, reading its prompt's KV),
  priced by the shared step model (kvflow.proto.step_model, the one the router's time
  scorer prices with), stays within ``headroom_fraction`` of the tightest online TPOT
  target. Every worker, because the router, not this rule, picks the line's worker.

Why a fraction of the target and not the whole of it: an online request's TPOT is the
mean of the steps it decodes in, and on a colocated worker those steps also carry the
prompts of the requests that arrive meanwhile. If prompts take a share ``u`` of a worker's
time, a mean step is the decode step / (1 - u); the requests that miss their TPOT are the
ones decoding through a burst of arrivals, twice the mean rate, where the decode step has
1 - 2u of their time. So the fraction is 1 - 2u at the peak: on the batch day
(docs/benchmarks.md, "Batch API: a batch at the peak") u = 0.36 (7 requests/s a worker x
256 prompt tokens x 0.2 ms), 1 - 2u = 0.28, hence the default 0.3. Measured there over 10
seeds: 0.3 leaves the online attainment within noise of the day without the batch (paired
difference -0.01 points, standard error 0.02), 0.4 and 0.5 do not (-0.05 and -0.13).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.proto.step_model import StepShape, StepTiming

# The share of the online TPOT target a worker's decode step may reach with a batch line
# added: 1 - twice the share of a worker's time the online prompts take at the peak (the
# module docstring says why, and why 0.3).
DEFAULT_TPOT_HEADROOM_FRACTION = 0.3


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What the rule reads of one worker's last load report."""

    num_waiting: int
    num_decode_seqs: int = 0
    num_kv_tokens: int = 0  # the KV its decoding sequences read each step


@dataclass(frozen=True, slots=True)
class TpotHeadroom:
    """The online TPOT the batch must leave alone: the tightest online class's target
    (seconds) and the share of it a decode step may take with a line added."""

    target_s: float
    fraction: float = DEFAULT_TPOT_HEADROOM_FRACTION

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"the online TPOT target must be > 0 s, got {self.target_s}")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"the TPOT headroom fraction must be in (0, 1], got {self.fraction}")

    @property
    def limit_s(self) -> float:
        return self.target_s * self.fraction


def has_spare_capacity(num_waiting: Iterable[int]) -> bool:
    """No worker of the pool reports requests waiting: what runs now has every slot it
    needs, so a batch line delays nobody's first token."""
    return all(n <= 0 for n in num_waiting)


def decode_step_with_line_s(timing: StepTiming, worker: WorkerLoad, line_tokens: int) -> float:
    """The worker's decode step with the line decoding beside its sequences: one more
    sequence, and the line's ``line_tokens`` (its prompt) more KV read."""
    shape = StepShape(
        num_prefill_tokens=0,
        num_prefill_seqs=0,
        num_decode_seqs=worker.num_decode_seqs + 1,
        num_kv_tokens_read=worker.num_kv_tokens + line_tokens,
    )
    return timing.shape_s(shape)


def may_start_line(
    workers: Sequence[WorkerLoad],
    timing: StepTiming,
    line_tokens: int,
    headroom: TpotHeadroom | None,
) -> bool:
    """Spare capacity, and (with ``headroom``) every worker's decode step with the line
    within its limit: the module docstring's rule. ``headroom`` None: spare capacity only."""
    if not has_spare_capacity(w.num_waiting for w in workers):
        return False
    if headroom is None:
        return True
    return all(decode_step_with_line_s(timing, w, line_tokens) <= headroom.limit_s for w in workers)


def prompt_tokens_at_most(body: Mapping[str, Any]) -> int:
    """A line's prompt in tokens (``body``: its request body), at most: its text's UTF-8
    bytes (a token is at least one byte), without tokenizing it here."""
    prompt = body.get("messages", body.get("prompt", [body.get("instructions"), body.get("input")]))
    return len(json.dumps(prompt, ensure_ascii=False).encode())
