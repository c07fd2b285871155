"""A tensor-parallel group of worker processes on one machine: its store and its two groups.

Rank 0 (the worker ``kvflow worker`` starts) hosts a TCPStore on loopback; the ranks it
spawns (``leader.py``) join it. Two process groups over one store: one for the model's
sums and gathers (NCCL on GPUs, gloo on the CPU: ``tensor_parallel.GroupRanks``), one over
gloo for the plans rank 0 sends each step (``plan.py``), which are CPU data even when the
model runs on GPUs. A store key per rank says that rank has loaded its shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as _dist

from kvflow.engine_worker.model.tensor_parallel import GroupRanks
from kvflow.engine_worker.tp.plan import PlanChannel

dist: Any = _dist  # its stubs do not export the store and group classes
LOOPBACK = "127.0.0.1"
# A collective waits this long for a rank before it fails the step (and health reports
# the rank): a step is at most a second or two on a CPU, well under a second on a GPU. A
# rank that exits fails its peers' collectives at once (its sockets close); this bounds a
# rank that hangs.
COLLECTIVE_TIMEOUT_S = 60.0
# The ranks that follow wait for rank 0's next plan for as long as the worker is idle.
PLAN_WAIT_TIMEOUT = timedelta(days=3650)


@dataclass
class RankGroup:
    rank: int
    size: int
    ranks: GroupRanks  # the model's collectives
    plans: PlanChannel  # rank 0's step plans
    store: Any

    def mark_ready(self) -> None:
        self.store.set(f"kvflow/tp/ready/{self.rank}", b"1")

    def wait_ready(self, alive: Callable[[], str | None], timeout_s: float) -> None:
        """Rank 0: wait for every other rank to load its shard. ``alive()`` names a rank
        that has exited (its failure is then this one's), or None."""
        deadline = time.monotonic() + timeout_s
        for rank in range(1, self.size):
            key = f"kvflow/tp/ready/{rank}"
            while True:
                if (problem := alive()) is not None:
                    raise RuntimeError(problem)
                if self.store.check([key]):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel rank {rank} did not load in {timeout_s} s")
                time.sleep(0.1)


def open_store(port: int = 0) -> Any:
    """Rank 0's store, on loopback (``port`` 0: any free one; ``.port`` says which)."""
    return dist.TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        use_libuv=True,
    )


def connect_store(port: int) -> Any:
    return dist.TCPStore(
        LOOPBACK,
        port,
        is_master=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        use_libuv=True,
    )


def join(store: Any, rank: int, size: int, *, cuda: bool) -> RankGroup:
    """Form both groups (blocks until every rank has joined)."""
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    compute_store = dist.PrefixStore("kvflow/tp/compute/", store)
    if cuda:
        compute = dist.ProcessGroupNCCL(compute_store, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        compute = dist.ProcessGroupGloo(compute_store, rank, size, timeout)
    plans_store = dist.PrefixStore("kvflow/tp/plans/", store)
    control = dist.ProcessGroupGloo(plans_store, rank, size, PLAN_WAIT_TIMEOUT)
    return RankGroup(rank, size, GroupRanks(compute, rank, size), PlanChannel(control), store)
