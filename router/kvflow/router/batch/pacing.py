"""When a batch line may start: the one rule the runner (batch/runner.py) and the simulator's
batch day (kvflow.sim.batch_day) share. Pure."""

from __future__ import annotations

from collections.abc import Iterable


def has_spare_capacity(num_waiting: Iterable[int]) -> bool:
    """No worker of the pool reports requests waiting: what runs now has every slot it
    needs, so a batch line delays nobody's first token. Any queue means online traffic is
    using the capacity, and the batch waits."""
    return all(n <= 0 for n in num_waiting)
