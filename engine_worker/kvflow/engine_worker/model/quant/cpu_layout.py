"""Where torch's CPU int4 packing puts each 4-bit code, so codes can be read back out.

``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` turns ``codes [N, K]`` into bytes the
kernel streams: rows in blocks of ``block_n`` (64 with AVX512, 32 otherwise), each block
``K`` runs of ``block_n / 2`` bytes, one run per column. Within a run, a full block on an
AVX512 or AVX2 build puts row ``r`` of the block at byte ``r mod block_n/2``, low nibble
for the first half of the rows and high nibble for the second; a partial last block (and
every block of a build without AVX) puts rows ``2b`` and ``2b + 1`` in byte ``b``.

kvflow reads codes back for two things: embedding rows (a tied Q8_0 embedding is also the
LM head, kept once) and whole matrices widened for large batches, where a bf16 GEMM beats
the kernel (``int4_weight.py``). The layout is the packing kernel's private choice, so
``check_layout`` packs a probe and reads it back before any weight relies on this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


class UnknownInt4LayoutError(RuntimeError):
    """This torch build packs int4 weights in a layout this module does not read."""


@dataclass(frozen=True)
class CpuInt4Layout:
    block_n: int  # rows per block
    interleaved: bool  # full blocks: row r at byte r mod block_n/2, nibble r // (block_n/2)

    def locate(self, rows: torch.Tensor, num_rows: int, num_cols: int) -> _Positions:
        """Byte offset of each row's column 0, its bytes per column, and its nibble shift."""
        half = self.block_n // 2
        block = rows // self.block_n
        within = rows % self.block_n
        block_rows = (num_rows - block * self.block_n).clamp(max=self.block_n)
        full = block_rows == self.block_n
        base = block * num_cols * half
        if self.interleaved:
            byte = torch.where(full, within % half, within // 2)
            shift = torch.where(full, 4 * (within // half), 4 * (within % 2))
        else:
            byte, shift = within // 2, 4 * (within % 2)
        stride = torch.where(full, half, block_rows // 2)
        return _Positions(base + byte, stride, shift)

    def read_rows(
        self, packed: torch.Tensor, rows: torch.Tensor, num_rows: int, num_cols: int
    ) -> torch.Tensor:
        """``codes[rows]`` ``[len(rows), num_cols]`` uint8 from the packed bytes."""
        half = self.block_n // 2
        full_blocks = num_rows // self.block_n
        if rows.numel() and int(rows.max()) < full_blocks * self.block_n:
            # Full blocks only (every row of a model whose size divides the block): one
            # gather of each row's byte column, no index per code.
            runs = packed.reshape(-1)[: full_blocks * num_cols * half]
            runs = runs.view(full_blocks, num_cols, half)
            block, within = rows // self.block_n, rows % self.block_n
            if self.interleaved:
                byte, shift = within % half, 4 * (within // half)
            else:
                byte, shift = within // 2, 4 * (within % 2)
            picked = runs[block, :, byte]  # [len(rows), num_cols]
            return (picked >> shift[:, None].to(torch.uint8)) & 0x0F
        pos = self.locate(rows, num_rows, num_cols)
        columns = torch.arange(num_cols, device=rows.device)
        index = pos.base[:, None] + pos.stride[:, None] * columns[None, :]
        nibbles = packed.reshape(-1)[index] >> pos.shift[:, None].to(torch.uint8)
        return nibbles & 0x0F

    def read_full_blocks(
        self, packed: torch.Tensor, num_cols: int, num_blocks: int, first_block: int = 0
    ) -> torch.Tensor:
        """The codes of ``num_blocks`` full blocks from ``first_block`` on, transposed:
        ``[num_cols, num_blocks * block_n]`` uint8 (the ``W.T`` a GEMM reads)."""
        half = self.block_n // 2
        start = first_block * num_cols * half
        runs = packed.reshape(-1)[start : start + num_blocks * num_cols * half]
        runs = runs.view(num_blocks, num_cols, half).transpose(0, 1)  # [cols, blocks, bytes]
        codes = torch.empty(num_cols, num_blocks, 2, half, dtype=torch.uint8)
        torch.bitwise_and(runs, 0x0F, out=codes[:, :, 0])
        torch.bitwise_right_shift(runs, 4, out=codes[:, :, 1])
        if not self.interleaved:  # row 2b + nibble
            return codes.transpose(2, 3).reshape(num_cols, num_blocks * self.block_n)
        return codes.view(num_cols, num_blocks * self.block_n)


@dataclass(frozen=True)
class _Positions:
    base: torch.Tensor  # [rows] int64
    stride: torch.Tensor  # [rows] int64
    shift: torch.Tensor  # [rows] int64, 0 or 4


def pack(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` (uint8, 0..15, K even) in the CPU kernel's layout.

    Packed 64 x 16 rows at a time: the packing op takes int32 codes, 4 bytes a weight, and a
    large embedding (128 k x 4 k) would need 2 GB of them at once. Blocks are independent
    and laid out in row order, so the chunks' bytes simply follow each other.
    """
    chunk = 1024  # a multiple of every block_n
    parts = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes[i : i + chunk].to(torch.int32), 1)
        for i in range(0, codes.shape[0], chunk)
    ]
    return torch.cat([p.reshape(-1) for p in parts]).view(codes.shape[0], codes.shape[1] // 2)


@cache
def cpu_layout() -> CpuInt4Layout:
    """This torch build's layout, checked by packing a probe and reading it back.

    Raises ``UnknownInt4LayoutError`` when no known layout reads the probe back.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    candidates = [CpuInt4Layout(64, True), CpuInt4Layout(32, True), CpuInt4Layout(32, False)]
    if capability.startswith("AVX512"):
        candidates.insert(0, candidates.pop(0))
    for layout in candidates:
        if _reads_back(layout):
            return layout
    raise UnknownInt4LayoutError(
        f"torch {torch.__version__} ({capability}) packs int4 weights in a layout kvflow does "
        "not know; run with --quantization none to widen quantized weights instead"
    )


def _reads_back(layout: CpuInt4Layout) -> bool:
    # Two full blocks of 64 and a partial one of 16; columns that tell rows apart.
    num_rows, num_cols = 2 * 64 + 16, 6
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (num_rows, num_cols), generator=gen, dtype=torch.uint8)
    packed = pack(codes)
    rows = torch.arange(num_rows)
    if not torch.equal(layout.read_rows(packed, rows, num_rows, num_cols), codes):
        return False
    full = num_rows // layout.block_n
    in_full = torch.arange(full * layout.block_n)  # read_rows' gather of whole blocks
    if not torch.equal(layout.read_rows(packed, in_full, num_rows, num_cols), codes[in_full]):
        return False
    block_codes = layout.read_full_blocks(packed, num_cols, full)
    return torch.equal(block_codes, codes[: full * layout.block_n].T)
