"""Run a function on every rank of a tensor-parallel group, one thread a rank, in this process.

The ranks share an in-memory store and talk over gloo on loopback, as real worker processes
do over the network: the collectives are the real ones, only the processes are threads
(each rank still builds its own model shard). Fast enough for parity tests of the sharded
model; the worker's own processes are tested in tests/engine/test_tensor_parallel_worker.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from kvflow.engine_worker.model.tensor_parallel import GroupRanks

R = TypeVar("R")


def on_ranks(size: int, fn: Callable[[GroupRanks], R], timeout_s: float = 60.0) -> list[R]:
    """``fn(ranks)`` on each of ``size`` ranks at once; their results in rank order."""
    store: Any = dist.HashStore()  # type: ignore[attr-defined]
    results: dict[int, R] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            prefixed = dist.PrefixStore("tp/", store)  # type: ignore[attr-defined]
            group = dist.ProcessGroupGloo(  # type: ignore[attr-defined]
                prefixed, rank, size, timedelta(seconds=timeout_s)
            )
            results[rank] = fn(GroupRanks(group, rank, size))
        except BaseException as err:  # re-raised in the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * 4)
    if errors:
        raise errors[0]
    assert len(results) == size, "a rank hung"
    return [results[r] for r in range(size)]
