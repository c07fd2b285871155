"""What a tensor-parallel model asks of its ranks: a sum across them and a gather to rank 0.

Megatron-style: each rank holds a slice of every matrix (``weights.py`` says which), so
one layer needs one sum of partial results after attention and one after the MLP, and the
vocabulary-split embedding one more; the LM head's slices of the logits meet on rank 0,
which samples. ``SingleRank`` is the one-device model (every call a no-op);
``GroupRanks`` runs the calls on a torch.distributed process group: NCCL on GPUs, gloo on
the CPU (``tp_group.py`` forms it).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TensorParallel(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the sum."""
        ...

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` side by side along the last dim, on rank 0 (None on the
        others)."""
        ...

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's ``tensor`` side by side along ``dim``, on rank 0 (None elsewhere)."""
        ...

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (every rank gets it)."""
        ...

    def scatter(self, whole: torch.Tensor | None, part: torch.Tensor, dim: int) -> None:
        """Rank 0's ``whole`` cut into equal slices along ``dim``: slice r into rank r's
        ``part`` (``whole`` is None on the other ranks)."""
        ...


class SingleRank:
    rank, size = 0, 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        return tensor

    def min_int(self, value: int) -> int:
        return value

    def scatter(self, whole: torch.Tensor | None, part: torch.Tensor, dim: int) -> None:
        assert whole is not None
        part.copy_(whole)


class GroupRanks:
    """The calls on a process group of ``size`` ranks (a torch ``ProcessGroup``)."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([tensor]).wait()
        return tensor

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return self.gather(tensor, -1)

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        tensor = tensor.contiguous()
        if self.rank != 0:
            self.group.gather([], [tensor], _options("GatherOptions")).wait()
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.gather([parts], [tensor], _options("GatherOptions")).wait()
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        options: Any = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        device = "cuda" if self.group.name() == "nccl" else "cpu"
        cell = torch.tensor([value], dtype=torch.int64, device=device)
        self.group.allreduce([cell], options).wait()
        return int(cell.item())

    def scatter(self, whole: torch.Tensor | None, part: torch.Tensor, dim: int) -> None:
        assert part.is_contiguous()
        if self.rank != 0:
            self.group.scatter([part], [], _options("ScatterOptions")).wait()
            return
        assert whole is not None
        slices = [s.contiguous() for s in whole.chunk(self.size, dim=dim)]
        self.group.scatter([part], [slices], _options("ScatterOptions")).wait()


def _options(kind: str) -> Any:
    """Rank 0 as the root of a gather or scatter."""
    import torch.distributed as dist

    options: Any = getattr(dist, kind)()
    options.rootRank = 0
    return options
