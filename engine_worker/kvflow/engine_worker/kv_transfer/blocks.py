"""The blocks one KV transfer moves, read and written in place in the paged cache.

A transfer is a stream of *runs*. A run is one block of one layer: its keys and values of
every KV head, contiguous in the block-major cache (model/paged_cache.py), 64 KiB for
Llama-3-8B in bf16. The stream goes layer by layer and within a layer through the blocks in
transfer order: the memory order of a ``[layers, blocks, *block]`` buffer. Each side
enumerates its own block ids in that order, so a run lands at the (layer, position) it left.
Neighbouring block ids are neighbouring runs in memory: vectored socket I/O merges them.

Transfer threads touch the cache only inside ``access()``, one bounded piece at a time (a
16 MiB message, one socket call). The engine thread calls ``revoke()`` before the blocks may
be freed or reused: it waits for a piece in progress, and every later access raises
TransferCancelledError. After ``revoke`` returns nothing reads or writes the blocks, so a
cancelled or timed-out transfer never leaks into blocks that another request now owns.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from kvflow.engine_worker.kv_transfer.base import TransferCancelledError

# A transfer is cut into at most this many messages (gloo tags leave 11 bits for the
# message index; see torch_dist). At 16 MiB a message that is 32 GiB; larger transfers get
# larger messages.
MAX_MESSAGES = 2048


def _wide_dtype(run_bytes: int) -> torch.dtype:
    """The widest element a run divides into: index_select/index_copy_ move wide elements
    faster (4 KiB runs here: scatter 7.3 GB/s as 16-byte elements, 5.8 as 8-byte, 4.0 as
    bf16; gather 8.2, 7.9 and 7.6; bytes are 8x slower). complex128 is only a 16-byte
    container: these kernels copy it bit for bit, doing no arithmetic on it."""
    for dtype in (torch.complex128, torch.int64, torch.int32, torch.int16):
        if run_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


class TransferBlocks:
    """Runs of a paged cache, addressed by their place in one transfer's stream."""

    def __init__(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
        """``caches``: per layer, a contiguous tensor ``[pool blocks, ...]`` (one run per
        block); ``block_ids``: the blocks to move, in transfer order. Cheap (tens of
        microseconds): the torch views a gather or scatter needs are made on first use, and
        in-place TCP never needs them."""
        self._caches = list(caches)
        first = self._caches[0]
        assert all(c.is_contiguous() and c.shape == first.shape for c in self._caches)
        self.run_bytes = first[0].numel() * first.element_size()
        self.device = first.device
        self._block_ids = np.asarray(block_ids, dtype=np.int64)
        self.runs_per_layer = len(self._block_ids)
        self.num_runs = len(self._caches) * self.runs_per_layer
        self.num_bytes = self.num_runs * self.run_bytes
        self._lock = threading.Lock()
        self._is_revoked = False

    @classmethod
    def in_cache(
        cls, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> TransferBlocks:
        """Blocks of a paged cache, one ``[pool_blocks, block_size, 2, kv_heads, head_dim]``
        tensor per layer (model/paged_cache.py)."""
        return cls(kv_caches, block_ids)

    @classmethod
    def of_buffer(cls, buffer: torch.Tensor) -> TransferBlocks:
        """A private contiguous buffer ``[num_blocks, ...]`` as one layer (a runner without a
        paged cache, or a test): the stream is the buffer's bytes."""
        return cls([buffer], range(buffer.shape[0]))

    @functools.cached_property
    def _dtype(self) -> torch.dtype:
        return _wide_dtype(self.run_bytes)

    @functools.cached_property
    def _tables(self) -> list[torch.Tensor]:
        """Per layer, the cache as [pool blocks, run] of the widest element type."""
        width = self.run_bytes // self._dtype.itemsize
        return [
            c.reshape(-1).view(torch.uint8).view(self._dtype).view(-1, width) for c in self._caches
        ]

    @functools.cached_property
    def _ids(self) -> torch.Tensor:
        return torch.from_numpy(self._block_ids).to(self.device)

    # -- access ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def access(self) -> Iterator[None]:
        """Hold the blocks for one bounded piece of I/O; raises once they were revoked."""
        with self._lock:
            if self._is_revoked:
                raise TransferCancelledError("the blocks were released: the transfer is over")
            yield

    def revoke(self) -> None:
        """End every access: waits for a piece in progress; later ones raise."""
        with self._lock:
            self._is_revoked = True

    @property
    def is_revoked(self) -> bool:
        return self._is_revoked

    # -- the stream --------------------------------------------------------------------------

    def messages(self, max_bytes: int) -> list[tuple[int, int]]:
        """The stream cut into messages of whole runs: (first run, number of runs)."""
        per_message = max(1, max_bytes // self.run_bytes, -(-self.num_runs // MAX_MESSAGES))
        return [
            (first, min(per_message, self.num_runs - first))
            for first in range(0, self.num_runs, per_message)
        ]

    def _pieces(self, first_run: int, num_runs: int) -> Iterator[tuple[int, int, int, int]]:
        """(layer, first run in the layer, offset in the range, runs) per layer touched."""
        done = 0
        while done < num_runs:
            layer, local = divmod(first_run + done, self.runs_per_layer)
            count = min(num_runs - done, self.runs_per_layer - local)
            yield layer, local, done, count
            done += count

    def _as_runs(self, data: torch.Tensor, num_runs: int) -> torch.Tensor:
        flat = data.reshape(-1).view(torch.uint8)[: num_runs * self.run_bytes]
        return flat.view(self._dtype).view(num_runs, -1)

    def read(self, first_run: int, num_runs: int, out: torch.Tensor) -> None:
        """Gather runs [first_run, first_run + num_runs) into the front of ``out`` (a
        contiguous tensor; call inside ``access()``)."""
        dst = self._as_runs(out, num_runs)
        gathered = dst if dst.device == self.device else torch.empty_like(dst, device=self.device)
        for layer, local, start, count in self._pieces(first_run, num_runs):
            ids = self._ids[local : local + count]
            torch.index_select(self._tables[layer], 0, ids, out=gathered[start : start + count])
        if gathered is not dst:
            dst.copy_(gathered)

    def write(self, first_run: int, num_runs: int, data: torch.Tensor) -> None:
        """Scatter the front of ``data`` into runs [first_run, first_run + num_runs) (call
        inside ``access()``). index_copy_ of 16-byte elements (measured on 4 KiB runs: 7.3 GB/s
        here, against 4.0 for a bf16 index_copy_ along the pool axis and 3.8 for one copy_
        per run)."""
        src = self._as_runs(data, num_runs).to(self.device)
        for layer, local, start, count in self._pieces(first_run, num_runs):
            ids = self._ids[local : local + count]
            self._tables[layer].index_copy_(0, ids, src[start : start + count])

    def iovecs(self) -> np.ndarray:
        """The whole stream as ``struct iovec`` entries (address, length; uint64 pairs) for
        vectored socket I/O straight from or into the cache (CPU only), adjacent runs
        merged: a cache that hands out consecutive block ids moves in long runs."""
        assert self.device.type == "cpu"
        offsets = self._block_ids.astype(np.uint64) * np.uint64(self.run_bytes)
        starts = np.concatenate([np.uint64(c.data_ptr()) + offsets for c in self._caches])
        if len(starts) == 0:
            return np.zeros((0, 2), dtype=np.uint64)
        run = np.uint64(self.run_bytes)
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + run) + 1
        first = np.concatenate([[0], breaks])
        lengths = np.diff(np.concatenate([first, [len(starts)]])).astype(np.uint64) * run
        return np.ascontiguousarray(np.stack([starts[first], lengths], axis=1))


@runtime_checkable
class InPlaceBlockIO(Protocol):
    """A runner whose transfers read and write its paged cache in place (TorchModelRunner);
    one without it (SimulatedRunner) moves private copies of its blocks."""

    def transfer_blocks(self, block_ids: Sequence[int]) -> TransferBlocks: ...
