"""The torch model runner: flatten a scheduled step, run the model over the paged cache, sample.

Tokens of all scheduled requests are laid end to end (no padding); the attention metadata
says where each one's K/V goes and what it attends to. Logits are computed only for the
rows that sample, one per request: a 512-token prefill chunk costs 1 row of the
``hidden x vocab`` head, not 512.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.model.attention import compute_dtype
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_graphs import DecodeGraphs, DecodeStep, GraphCaptureError
from kvflow.engine_worker.model.decode_workspace import Decode, DecodeWorkspace
from kvflow.engine_worker.model.kv_quant import layout_name, row_width
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel
from kvflow.engine_worker.sampler import Sampler
from kvflow.engine_worker.step_inputs import StepInputs, step_inputs

log = logging.getLogger(__name__)


class PagedModel(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


def kv_bytes_per_block(
    *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Keys and values of one block in every layer, in a cache of ``dtype`` (a quantized
    one's per-row scales included: kv_quant.py)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    width = row_width(head_dim, dtype)
    return 2 * num_layers * block_size * num_kv_heads * width * element_size


def kv_layout(
    *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: torch.dtype
) -> str:
    """What a block holds, as PD peers compare it: a transfer between layouts that differ is
    refused by name at the handshake. Its last field is the cache's dtype (kv_quant.py)."""
    return f"L{num_layers}/H{num_kv_heads}/D{head_dim}/B{block_size}/{layout_name(kv_dtype)}"


class TorchModelRunner:
    def __init__(
        self,
        model: PagedModel,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        sampler: Sampler | None = None,
        decode_workspace_bytes: int = 0,
        decode_graph_batch: int = 0,
        max_model_len: int | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        paged_kernel: bool = True,
    ) -> None:
        """``dtype`` is the model's; ``kv_cache_dtype`` the cache's (None: the model's; int8
        or float8_e4m3fn: quantized, model/kv_quant.py).

        ``decode_workspace_bytes``: memory for dense copies of the decoding sequences'
        K/V (model/decode_workspace.py), so decode attention reads no per-step gather; 0:
        none, every decode gathers from the paged cache. Unused where decodes read the
        cache in place through a paged kernel (model/paged_kernel.py; ``paged_kernel``
        False: never).

        ``decode_graph_batch``: pure decode steps of up to this many sequences (over at most
        ``max_model_len`` tokens) replay from CUDA graphs (model/decode_graphs.py) on a CUDA
        device, and run the same padded step eagerly elsewhere; 0: every step eager."""
        assert not (decode_workspace_bytes and decode_graph_batch), (
            "a decode step reads the workspace or replays a graph, not both"
        )
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = sampler or Sampler(self.device)
        # Padded rows of a graphed step write their K/V into a block the pool never hands out.
        cache_blocks = num_blocks + 1 if decode_graph_batch else num_blocks
        kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        shape = kv_cache_shape(
            num_blocks=cache_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in range(num_layers)
        ]
        # Decodes read the cache in place where a paged kernel runs (a GPU's, or the CPU's):
        # then a workspace's copies would only cost memory.
        self.paged_kernel = paged_kernel and uses_paged_kernel(
            self.device, block_size, kv_dtype, compute_dtype(dtype, self.device)
        )
        self.workspace: DecodeWorkspace | None = None
        if decode_workspace_bytes > 0 and not self.paged_kernel:
            self.workspace = DecodeWorkspace(
                num_layers=num_layers,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                # The attention's dtype, so that reading a slot converts nothing (a quantized
                # cache's slots hold its dequantized values).
                dtype=compute_dtype(dtype, self.device),
                device=self.device,
                max_bytes=decode_workspace_bytes,
            )
        self.graphs: DecodeGraphs | None = None
        if decode_graph_batch > 0:
            max_blocks = num_blocks
            if max_model_len is not None:
                max_blocks = min(max_blocks, -(-max_model_len // block_size))
            self.graphs = DecodeGraphs(
                self._decode_forward,
                block_size=block_size,
                scratch_slot=num_blocks * block_size,
                max_batch=decode_graph_batch,
                max_blocks=max_blocks,
                device=self.device,
                capture=self.device.type == "cuda",
            )
        # The bytes of a block, as a PD peer must hold them: its last field is the KV dtype
        # (wire_checks.py refuses a peer whose layout differs and names that field).
        self.kv_layout = kv_layout(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            kv_dtype=kv_dtype,
        )

    # -- whole blocks in and out (PD) ------------------------------------------------------
    # Transfers read and write the blocks in place (transfer_blocks); the buffered calls are
    # the same stream as one [layers, num_blocks, block_size, 2, kv_heads, head_dim] buffer.

    def transfer_blocks(self, block_ids: Sequence[int]) -> TransferBlocks:
        """These blocks of every layer, in place, for a KV transfer to read or write."""
        return TransferBlocks.in_cache(self.kv_caches, block_ids)

    def empty_blocks(self, num_blocks: int) -> torch.Tensor:
        """A buffer for ``num_blocks`` blocks of every layer."""
        block_shape = self.kv_caches[0].shape[1:]
        shape = (len(self.kv_caches), num_blocks, *block_shape)
        return torch.empty(shape, dtype=self.kv_caches[0].dtype, device=self.device)

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy of these blocks' K/V in every layer."""
        blocks = self.transfer_blocks(block_ids)
        out = self.empty_blocks(len(block_ids))
        blocks.read(0, blocks.num_runs, out)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Scatter a buffer from ``read_blocks`` (of a peer) into these blocks."""
        blocks = self.transfer_blocks(block_ids)
        assert data.numel() * data.element_size() == blocks.num_bytes
        blocks.write(0, blocks.num_runs, data.contiguous())

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self.workspace is not None:
            self.workspace.release(request_id)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        logits = self.forward(step_inputs(output))
        if logits is None:
            return {}
        return self.sample(logits, [s.request for s in output.scheduled if s.samples])

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run the step's forward pass: every new token's K/V written to its blocks, and the
        float32 logits of the sequences that sample, in order (None when none samples, or
        on a tensor-parallel rank other than 0). What every rank runs, from the same
        ``inputs``."""
        if self.workspace is None:
            return self._forward(inputs)
        for request_id in inputs.preempted:  # its blocks are freed; its copy must not outlive
            self.workspace.release(request_id)
        try:
            return self._forward(inputs)
        except BaseException:
            # The plan marked slots filled before the layers filled them.
            self.workspace.reset()
            raise

    def _decode_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        logits = self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))
        assert logits is not None, "CUDA graphs run on one rank"
        return logits

    def _graph_step(self, inputs: StepInputs) -> DecodeStep | None:
        """The step as ``DecodeGraphs`` takes it, if it is a pure decode step that fits."""
        assert self.graphs is not None
        if not inputs.seqs or not all(s.num_new_tokens == 1 and s.samples for s in inputs.seqs):
            return None
        bs = self.block_size
        step = DecodeStep([], [], [], [], [])
        for s in inputs.seqs:
            position = s.num_computed_tokens
            table = s.block_ids[: position // bs + 1]
            step.token_ids.append(s.new_token_ids[0])
            step.positions.append(position)
            step.slots.append(table[-1] * bs + position % bs)
            step.block_tables.append(table)
            step.context_lens.append(position + 1)
        longest = max(len(t) for t in step.block_tables)
        return step if self.graphs.fits(len(step.token_ids), longest) else None

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        if self.graphs is not None and (step := self._graph_step(inputs)) is not None:
            try:
                return self.graphs.run(step)
            except GraphCaptureError as exc:
                # Serving goes on without graphs: this step and every later one run eagerly.
                log.warning("CUDA graphs off from now on, decode steps run eagerly: %s", exc)
                self.graphs = None
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        for s in inputs.seqs:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            input_ids.extend(s.new_token_ids)
            positions.extend(range(start, end))
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            block_tables.append(s.block_ids)
            if s.samples:
                sample_rows.append(len(input_ids) - 1)

        workspace = None
        if self.workspace is not None:
            decodes = [
                Decode(s.request_id, row, ctx, s.block_ids, s.final_len)
                for s, row, ctx in zip(
                    inputs.seqs, _first_rows(query_lens), context_lens, strict=True
                )
                if s.num_new_tokens == 1
            ]
            workspace = self.workspace.plan(decodes, all_rows=len(decodes) == len(input_ids))
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            device=self.device,
            workspace=workspace,
            paged_kernel=self.paged_kernel,
        )
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        # The rows to sample go to the device before the forward is queued: a copy after it
        # would wait for the whole forward to finish before the head could be queued.
        rows_t = None
        if sample_rows and len(sample_rows) < len(input_ids):
            rows_t = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_caches, meta)
        if not sample_rows:
            return None
        if rows_t is not None:
            hidden = hidden[rows_t]
        # else every row samples (a pure decode step): no gather of the rows
        return self.model.compute_logits(hidden)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> dict[str, SampledToken]:
        tokens = self.sampler.sample(
            logits,
            [r.request_id for r in requests],
            [r.sampling for r in requests],
            histories=requests,
        )
        return {r.request_id: t for r, t in zip(requests, tokens, strict=True)}


def _first_rows(query_lens: list[int]) -> list[int]:
    """Each sequence's first row in the flattened batch."""
    rows, row = [], 0
    for n in query_lens:
        rows.append(row)
        row += n
    return rows
