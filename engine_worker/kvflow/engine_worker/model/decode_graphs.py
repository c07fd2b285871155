"""Pure decode steps replayed from CUDA graphs, one graph per (batch, context) bucket.

A decode step adds one token per sequence through some 25 kernels per layer: 800 launches
for a 32-layer model. At batch 1 on a GPU, launching them from Python takes longer than the
GPU's work (Llama-3-8B streams its 15 GB of weights in about 3.3 ms on an H200). A CUDA
graph records the launches once and replays them in one call.

A graph replays fixed shapes at fixed addresses, so a step is padded to a *bucket*: the
batch to the next power of two, and every block table to the next power of two of the
longest one. Its inputs are packed on the host into one tensor, copied in one transfer into
a device buffer that lives as long as the graphs, and each bucket's graph reads its views of
that buffer. Padded rows write their K/V into a scratch slot that no request owns (the
runner gives the cache one block more than the pool hands out) and attend to one token of
block 0, so their softmax has no NaN; their logits are dropped. Attention is the paged
kernel of triton_paged.py, reading the context lengths from the packed buffer (or, where
Triton is missing, the masked gather of ``attention._decode``, its mask computed inside the
graph from the context lengths).

Only pure decode steps (every sequence adds one token and samples) replay; a step with a
prefill chunk, a batch over ``max_batch``, a table over ``max_blocks`` or more padded tokens
than ``MAX_PADDED_TOKENS`` runs eagerly. Graphs are captured on first use of their bucket,
so the first step of each bucket pays a capture (two warm-up forwards and a recording); a
capture that fails raises ``GraphCaptureError``, and the runner turns graphs off. Without
``capture`` (a CPU has no graphs) the same padded step runs eagerly: that is how the tests
hold this path to the engine's own, token for token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.engine_worker.model.attention_metadata import AttentionMetadata, DecodeBatch
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel

log = logging.getLogger(__name__)

# (token ids [B], positions [B], metadata) -> float32 logits [B, vocab]; the K/V it writes
# and the weights it reads must stay at the same addresses for as long as the graphs live.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

# Tokens a padded step may gather per layer (batch bucket x table bucket x block size); a
# larger step runs eagerly, whose gather pads less. For Llama-3-8B in bf16 (4 KiB of K/V
# per token and layer) this is 1 GiB of transient gather: 256 sequences of up to 1,024
# tokens, or 16 of 16,384.
MAX_PADDED_TOKENS = 1 << 18

# How many warm-up forwards run before a capture: the first call of an op may allocate
# (cuBLAS workspaces, SDPA's choice of kernel), which a capture must not see.
WARMUP_FORWARDS = 2


class GraphCaptureError(RuntimeError):
    """A bucket's graph could not be recorded; the step it was for has not run."""


@dataclass(frozen=True)
class DecodeStep:
    """One pure decode step on the host: row ``i`` is one sequence adding one token."""

    token_ids: list[int]
    positions: list[int]  # of the new token: its context length minus one
    slots: list[int]  # where its K/V goes: block_id * block_size + offset
    block_tables: list[list[int]]  # the blocks its context lives in, no more
    context_lens: list[int]  # tokens it attends to, the new one included


def bucket(n: int) -> int:
    """The smallest power of two at least ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass
class _Bucket:
    forward: Callable[[], torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output, rewritten by each replay


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        *,
        block_size: int,
        scratch_slot: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        """``capture``: record CUDA graphs (the device must be a CUDA one); False: run the
        same padded steps eagerly."""
        assert not capture or device.type == "cuda", "CUDA graphs need a CUDA device"
        self._forward = forward
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = device
        self.capture = capture
        # Packed inputs of the largest bucket: ids, positions, slots, context lengths
        # ([B] each), then the block table [B, N]; a bucket reads its own prefix.
        batch, blocks = bucket(max_batch), bucket(max_blocks)
        self._packed = torch.zeros(batch * (4 + blocks), dtype=torch.int64, device=device)
        self._token_index = torch.arange(blocks * block_size, device=device)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        # One memory pool for every bucket's graph: they never run at once, and each
        # step reads its own graph's logits before another graph replays, which is what
        # makes sharing safe whatever order they replay in.
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # decode steps run here
        self.captures = 0  # graphs recorded so far
        self.capture_s = 0.0  # seconds spent recording them, warm-ups included

    def fits(self, batch: int, blocks: int) -> bool:
        """Whether a decode step of ``batch`` sequences, the longest on ``blocks`` blocks,
        runs here."""
        return (
            1 <= batch <= self.max_batch
            and blocks <= self.max_blocks
            and bucket(batch) * bucket(blocks) * self.block_size <= MAX_PADDED_TOKENS
        )

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """The (batch, blocks) buckets that have run, each with its graph once captured."""
        return sorted(self._buckets)

    def run(self, step: DecodeStep) -> torch.Tensor:
        """Float32 logits ``[batch, vocab]`` of the step's new tokens, its K/V written to the
        cache. The tensor is the graph's output: it holds until the next ``run``."""
        batch = len(step.token_ids)
        blocks = max(len(t) for t in step.block_tables)
        assert self.fits(batch, blocks), (batch, blocks)
        key = (bucket(batch), bucket(blocks))
        packed = self._pack(step, *key)
        self._packed[: packed.numel()].copy_(packed, non_blocking=True)
        entry = self._buckets.get(key)
        if entry is None:
            entry = self._buckets[key] = self._record(*key)
        self.steps += 1
        if entry.graph is None:
            return entry.forward()[:batch]
        entry.graph.replay()
        assert entry.logits is not None
        return entry.logits[:batch]

    def _pack(self, step: DecodeStep, batch: int, blocks: int) -> torch.Tensor:
        """The step's inputs padded to the bucket, in the layout ``_step`` reads."""
        pad = batch - len(step.token_ids)
        table: list[int] = []
        for row in step.block_tables:
            table += row
            table += [0] * (blocks - len(row))
        table += [0] * (pad * blocks)
        values = (
            step.token_ids
            + [0] * pad
            + step.positions
            + [0] * pad
            + step.slots
            + [self.scratch_slot] * pad
            + step.context_lens
            + [1] * pad  # a padded row attends to one token: block 0's first
            + table
        )
        # Pinned, so the copy to the device does not wait for the GPU to go idle.
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def _step(self, batch: int, blocks: int) -> torch.Tensor:
        """The padded step of one bucket over its views of the packed buffer."""
        p = self._packed
        ids, positions, slots, context_lens = (p[i * batch : (i + 1) * batch] for i in range(4))
        table = p[4 * batch : 4 * batch + batch * blocks].view(batch, blocks)
        num_tokens = blocks * self.block_size
        if uses_paged_kernel(self.device, self.block_size):
            # The paged kernel reads each row's own tokens in place: no gather, no mask.
            decode = DecodeBatch(
                rows=None,
                block_ids=table,
                num_tokens=num_tokens,
                mask=None,
                context_lens=context_lens,
            )
        else:
            real = self._token_index[:num_tokens] < context_lens[:, None]  # [B, T]
            decode = DecodeBatch(
                rows=None, block_ids=table, num_tokens=num_tokens, mask=real[:, None, None, :]
            )
        meta = AttentionMetadata(slot_mapping=slots, prefills=(), decodes=(decode,))
        return self._forward(ids, positions, meta)

    def _record(self, batch: int, blocks: int) -> _Bucket:
        def forward() -> torch.Tensor:
            return self._step(batch, blocks)

        if not self.capture:
            return _Bucket(forward)
        # The warm-ups and the recording run this step's real inputs: they write the same
        # K/V into the same slots that the replay after them (or the eager step that
        # replaces it, if the capture fails) writes again.
        start = time.perf_counter()
        try:
            # The capture's streams on the cache's GPU, whatever this thread's current one.
            with torch.cuda.device(self.device):
                logits, graph = self._capture(forward)
        except Exception as exc:
            raise GraphCaptureError(f"capturing the {batch} x {blocks} bucket: {exc}") from exc
        elapsed_s = time.perf_counter() - start
        self.captures += 1
        self.capture_s += elapsed_s
        log.info(
            "captured the CUDA graph of %d x %d blocks in %.0f ms", batch, blocks, 1e3 * elapsed_s
        )
        return _Bucket(forward, graph, logits)

    def _capture(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.cuda.CUDAGraph]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_FORWARDS):
                forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Captures happen while the worker serves, and KV transfers run in threads of
        # their own (kv_transfer/agent.py) that may allocate meanwhile: "thread_local"
        # forbids unsafe calls in this thread only, where "global" would fail theirs.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        return logits, graph
