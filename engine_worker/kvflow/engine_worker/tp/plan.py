"""Each step's plan, from rank 0 to the ranks that follow it, over a CPU process group.

Rank 0 alone runs the scheduler; the others only run the model. Before each forward pass
rank 0 broadcasts what the pass is over (``step_inputs.StepInputs``) and which requests'
per-request state to drop, and every rank then runs that same forward. Two broadcasts a
step (the length, then the bytes) over gloo: about 0.1-0.3 ms on one machine, against
steps of milliseconds. The payload is a pickle: both ends are this code, in one pod.

Between steps a plan may instead move KV blocks for a transfer between workers (PD): every
rank's share of some blocks gathered to rank 0, or rank 0's blocks scattered to the ranks.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.engine_worker.step_inputs import StepInputs


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One of: a forward pass (``inputs``), a KV gather or scatter, or stop (none set)."""

    inputs: StepInputs | None = None
    released: list[str] = field(default_factory=list)  # requests done since the last plan
    gather_blocks: list[int] | None = None  # send rank 0 your share of these blocks
    scatter_blocks: list[int] | None = None  # take your share of these blocks from rank 0

    @property
    def is_stop(self) -> bool:
        return self.inputs is None and self.gather_blocks is None and self.scatter_blocks is None


class PlanChannel:
    """Broadcasts from rank 0 over ``group`` (a gloo ``ProcessGroup``)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, plan: StepPlan) -> None:
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        self._broadcast(torch.tensor([len(payload)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def receive(self) -> StepPlan:
        size = torch.empty(1, dtype=torch.int64)
        self._broadcast(size)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self._broadcast(payload)
        plan = pickle.loads(payload.numpy().tobytes())
        assert isinstance(plan, StepPlan)
        return plan

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options: Any = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
