"""Attention metadata: where a step's new tokens go in the paged cache and what each one
attends to, built once per step and read by every layer (attention.py).

Sequences with more than one new token (prefill chunks) are attended one at a time;
single-token decodes go in padded batches, because padding costs far less than a Python
loop over 64 SDPA calls. Decodes are sorted by context length and cut into up to
``MAX_DECODE_GROUPS`` batches of similar lengths: one batch padded to the longest of 64
contexts spread over 64..512 tokens gathers about 1.8x the tokens it uses; four batches,
about 1.15x. Where the paged kernel runs (paged_kernel.py) the decodes are one batch with no
padding to cut: the kernel reads each row's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvflow.engine_worker.model.decode_workspace import WorkspaceStep
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel

MAX_DECODE_GROUPS = 4
# Below 8 sequences a group's padding costs less than another SDPA call and gather.
MIN_DECODE_GROUP = 8


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with ``query_len`` new tokens at the end of ``context_len`` tokens."""

    query_start: int  # row of its first new token in the flattened batch
    query_len: int
    context_len: int  # tokens it attends to, the new ones included
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64
    first_block: int | None = None  # its blocks are consecutive from here: a view, no gather


@dataclass(frozen=True)
class DecodeBatch:
    """Sequences with exactly one new token each, padded to the longest context."""

    rows: torch.Tensor | None  # [B] int64: their rows in the flattened batch; None: all, in order
    block_ids: torch.Tensor  # [B, max_blocks] int64 (padding points at block 0)
    num_tokens: int  # the longest context: tokens gathered per sequence
    # [B, 1, 1, num_tokens] bool, True where a real token is; None when no row is padded.
    mask: torch.Tensor | None
    first_block: int | None = None  # one sequence on consecutive blocks from here: no gather
    # [B] int64: each row's context; set on CUDA, where the paged kernel reads it instead of
    # a gather and a mask (triton_paged.py).
    context_lens: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: the slot each new token's K/V is written to
    prefills: tuple[PrefillSeq, ...]
    decodes: tuple[DecodeBatch, ...]
    # Decodes served from dense per-sequence copies (decode_workspace.py) instead of
    # ``decodes``; ``layer_kv`` is this layer's (keys, values) of them (see ``layer``).
    workspace: WorkspaceStep | None = None
    layer_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer(self, index: int) -> AttentionMetadata:
        """The metadata as layer ``index`` reads it: with its own workspace tensors."""
        if self.workspace is None:
            return self
        return replace(self, layer_kv=self.workspace.layers[index])

    @staticmethod
    def build(
        *,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        workspace: WorkspaceStep | None = None,
        paged_kernel: bool | None = None,
    ) -> AttentionMetadata:
        """Metadata for sequences laid out one after another in the flattened batch.

        Sequence ``i`` has ``query_lens[i]`` new tokens, the last of its
        ``context_lens[i]`` tokens, stored in the blocks ``block_tables[i]``. With a
        ``workspace`` (planned for exactly the one-token rows), those rows attend through
        it and get no ``DecodeBatch``. ``paged_kernel``: whether decodes attend through a
        paged kernel (paged_kernel.py; the runner decides, knowing the cache's dtype); None:
        where the GPU's runs.
        """
        assert len(query_lens) == len(context_lens) == len(block_tables)
        # Slot of each new token: position p of a sequence lives in block table[p // B]
        # at offset p % B. Plain Python: for decodes (one token each) it beats tensor ops.
        slots: list[int] = []
        for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            assert len(table) * block_size >= ctx, "block table too short for the context"
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)
            )
        slot_mapping = torch.tensor(slots, dtype=torch.int64)

        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        row = 0
        for q, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            used = table[: -(-ctx // block_size)]
            if q == 1 and workspace is not None:
                pass  # served by the workspace
            elif q == 1:
                decode_rows.append(row)
                decode_tables.append(used)
                decode_lens.append(ctx)
            else:
                ids = torch.tensor(used, dtype=torch.int64, device=device)
                prefills.append(PrefillSeq(row, q, ctx, ids, _first_if_consecutive(used)))
            row += q

        decodes: list[DecodeBatch] = []
        order = sorted(range(len(decode_rows)), key=lambda i: decode_lens[i])
        group_size = -(-len(order) // MAX_DECODE_GROUPS) if order else 1
        group_size = max(group_size, MIN_DECODE_GROUP)
        kernel = paged_kernel
        if kernel is None:
            kernel = uses_paged_kernel(torch.device(device), block_size)
        if kernel:  # the kernel reads each row's own tokens: one batch, no padding to cut
            group_size = max(group_size, len(order))
        # The rows of a single group that holds every token of the step, in order, need no
        # gather from q nor scatter into the output (a pure decode step of one group).
        all_rows = len(decode_rows) == row and len(order) <= group_size
        for start in range(0, len(order), group_size):
            members = order[start : start + group_size]
            if all_rows:
                members = list(range(len(order)))
            lens = [decode_lens[i] for i in members]
            max_blocks = max(len(decode_tables[i]) for i in members)
            # One padded table, built in Python and converted once.
            padded = [
                decode_tables[i] + [0] * (max_blocks - len(decode_tables[i])) for i in members
            ]
            longest = max(lens)
            mask = None
            if min(lens) != longest and not kernel:
                positions = torch.arange(longest)
                mask = (positions[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
                mask = mask.to(device)
            first = _first_if_consecutive(padded[0]) if len(members) == 1 else None
            rows = None
            if not all_rows:
                rows = torch.tensor([decode_rows[i] for i in members], dtype=torch.int64)
                rows = rows.to(device)
            decodes.append(
                DecodeBatch(
                    rows=rows,
                    block_ids=torch.tensor(padded, dtype=torch.int64, device=device),
                    num_tokens=longest,
                    mask=mask,
                    first_block=None if kernel else first,
                    context_lens=(
                        torch.tensor(lens, dtype=torch.int64, device=device) if kernel else None
                    ),
                )
            )
        return AttentionMetadata(
            slot_mapping.to(device), tuple(prefills), tuple(decodes), workspace=workspace
        )


def _first_if_consecutive(table: list[int]) -> int | None:
    """The first block id if ``table`` is a run of consecutive ids (a fresh pool hands them
    out so), else None: such blocks are one slice of the cache, read with no copy."""
    first = table[0]
    return (
        first
        if table[-1] - first == len(table) - 1 and table == list(range(first, first + len(table)))
        else None
    )
