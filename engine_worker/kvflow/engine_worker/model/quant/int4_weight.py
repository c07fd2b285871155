"""A weight matrix kept as 4-bit planes, multiplied by torch's int4 kernels.

``Int4Weight.matmul(x)`` is ``x @ W.T``:

- **Few rows** (decode steps, an LM head over the sampled rows): a kernel that reads the
  4-bit codes and their bf16 scales and never widens ``W``. On a CPU with AVX2, kvflow's
  own (``gemv_int4.c``, compiled on first use, ``native.py``): activations float32, exact,
  or (``gemv_activations``, asked for, AVX2's packing only) rounded to int8 per 32 columns
  and integer dot products; threads shared with torch. It reads a 16384 x 2048 matrix at
  9-13 GB/s on 2 threads of an AMD EPYC (Zen 3), 27-33 with int8 activations, where torch's
  kernel reads 8; with AVX512 (a Xeon) a decode step of Llama-3.2-1B's shape 1.2x as fast
  as torch's kernel. Elsewhere (no AVX2, no C compiler, or ``KVFLOW_INT4_GEMV=torch``)
  torch's weight-only int4 kernel, which is vectorized for bf16 activations only (float32
  runs a scalar loop, 30x slower), so ``x`` goes in as bf16 and the result, bf16, is
  widened back.
- **Many rows** (prefill chunks, large decode batches): the kernel's cost grows by about
  40 us per row for that matrix, a GEMM's hardly at all (512 rows: kernel 25.9 ms, bf16
  GEMM 1.5 ms). So from ``WIDEN_MIN_ROWS`` rows on (``WIDEN_MIN_ROWS_AMX`` with AMX's
  GEMMs) the matrix is widened for this one call, a chunk of rows at a time into a
  temporary, and multiplied by a bf16 GEMM (float32 on CPUs without native bf16). Peak
  memory grows by one chunk, not by the model.

On CUDA the same planes go to tinygemm (``_weight_int4pack_mm``), which handles every batch
size itself.
"""

from __future__ import annotations

import os
from functools import cache
from typing import cast

import numpy as np
import torch
from torch import nn

from kvflow.engine_worker.model.quant.cpu_layout import cpu_layout, pack
from kvflow.engine_worker.model.quant.native import (
    GEMV_INT8_BLOCK,
    check_gemv_weight,
    native_gemv,
    native_widener,
)
from kvflow.engine_worker.model.quant.planes import Int4Planes

#: From this many rows of ``x`` on, widen and GEMM instead of the kernel (CPU). The kernel
#: costs about 22 ps a weight per row (40 us a row for 3072 x 576 on one core); widening
#: costs about 0.3 ns a weight natively with AVX512 (``native.py``), 1.5 with torch ops, and
#: then the GEMM. With AMX's bf16 GEMMs (a Xeon) the two cross near 16 rows natively, and
#: 48 leaves the kernel its batches of a few dozen. Everywhere else they cross near 100-128
#: rows: on a Zen 4 EPYC (AVX512-BF16 GEMMs, no AMX; 2 threads, kvflow's AVX512 loop) the
#: kernel took 0.68-0.75x the widened product's time at 64 rows (16384 x 2048, 2048 x 2048,
#: 2048 x 8192), 0.75-0.99 at 96, 0.77-1.15 at 128, 1.25-1.58 at 256; without native bf16
#: (an AVX2 CPU: widening runs its generic loop, about 2 ns a weight, and the GEMM is float32)
#: widening wins only from about 128 rows (16384 x 2048 on an AMD EPYC, 2 threads: 55 ms for
#: either kernel at 64 rows, 76 widened; 123-129 and 113 at 128).
WIDEN_MIN_ROWS_AMX = 48
WIDEN_MIN_ROWS = 128
#: kvflow's GEMV on int8 activations multiplies 32 codes an instruction where a float32 GEMM
#: does 8 products, so it beats widening for a float32 GEMM far past 128 rows: 2 threads of
#: an AMD EPYC, GEMV / widened at 128 rows 0.47-0.69x (2048 x 2048, 16384 x 2048, 2048 x
#: 8192), at 512 rows 1.13, 0.75 and 0.95x.
WIDEN_MIN_ROWS_INT8_GEMV = 512
#: Rows of ``W`` widened at once, and the length of the widened ``W.T``'s rows: 1 Ki keeps
#: a block's 128-byte writes (one per column) on a few pages, and the temporary small (8 MiB
#: for 4 Ki columns in bf16; a 128 k-token LM head would be 1 GiB whole). 3 Ki rows at a
#: time widened 20 % slower on SmolLM2's shapes.
WIDEN_CHUNK_ROWS = 1024
#: The kernels' N must be a multiple of 16 (CPU) and 8 (CUDA): rows are padded to it.
_ROW_ALIGN = 16


class Int4Weight(nn.Module):
    """``W [rows, cols]`` as packed 4-bit planes plus bf16 scales and zeros per group."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    row_codes: torch.Tensor | None

    def __init__(self, planes: Int4Planes, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.rows, self.cols = planes.rows, planes.cols
        self.num_planes, self.group_size = planes.num_planes, planes.group_size
        self.device = torch.device(device)
        padded = -(-self.rows // _ROW_ALIGN) * _ROW_ALIGN
        self.padded_rows = padded
        codes = torch.from_numpy(np.ascontiguousarray(planes.codes))
        scales = torch.from_numpy(np.ascontiguousarray(planes.scales))
        zeros = torch.from_numpy(np.ascontiguousarray(planes.zeros))
        if padded != self.rows:  # code 8 with scale and zero 0 is a weight of 0
            extra = padded - self.rows
            codes = torch.cat([codes, torch.full((extra, codes.shape[1]), 8, dtype=torch.uint8)])
            scales = torch.cat([scales, scales.new_zeros(extra, scales.shape[1])])
            zeros = torch.cat([zeros, zeros.new_zeros(extra, zeros.shape[1])])
        # [groups, rows, 2] bf16: torch's kernels' scale-and-zero tensor; block-major
        # [blocks, groups, block_n, 2] for kvflow's GEMV (``native``), which reads a block's
        # scales as one run (``gemv_int4.c``).
        scales_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16)
        # Read on every machine, so a bad value is refused where the GEMV is not used too.
        activations = gemv_activations()
        self.native = self.device.type == "cpu" and use_native_gemv()
        #: The GEMV rounds ``x`` to int8 (``gemv_activations``); its products are then not
        #: float32-exact, and an LM head refines its top logits (``linear.head_logits``).
        self.int8_activations = (
            self.native and activations == "int8" and self.cols % GEMV_INT8_BLOCK == 0
        )
        if self.native:
            scales_zeros = _block_major(scales_zeros, cpu_layout().block_n)
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(self.device))
        # (cpu_layout probes torch's CPU packing: only CPU weights need it)
        layout = cpu_layout() if self.device.type == "cpu" else None
        self._block_n = layout.block_n if layout else 0
        self._interleaved = int(layout.interleaved) if layout else 0
        self.row_codes = None
        if self.device.type == "cuda":
            self.register_buffer("packed", _pack_cuda(codes.to(self.device)))
            # tinygemm's tiles are not read back here: rows come from a plain copy
            # (embeddings only; see ``keep_rows``).
        else:
            self.register_buffer("packed", pack(codes))
        if self.native:
            check_gemv_weight(
                self.packed, self.scales_zeros, self.cols, self.num_planes, self.group_size,
                self._block_n,
            )  # fmt: skip

    def keep_rows(self, planes: Int4Planes) -> None:
        """Keep the codes in plain row order too, for ``take_rows`` on CUDA (an embedding)."""
        if self.device.type == "cuda":
            codes = torch.from_numpy(np.ascontiguousarray(planes.codes)).to(self.device)
            self.register_buffer("row_codes", codes)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.row_codes is None else self.row_codes.nbytes
        return self.packed.nbytes + self.scales_zeros.nbytes + extra

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, cols] @ W.T`` -> ``[M, rows]`` in ``x``'s dtype."""
        assert x.shape[-1] == self.cols, (x.shape, self.cols)
        if self.device.type == "cpu" and x.shape[0] >= self.widen_min_rows():
            return self._matmul_widened(x)
        if self.native:
            return self._matmul_native(x)
        xb = x.to(torch.bfloat16)
        if self.num_planes > 1:  # every plane multiplies the same x
            xb = xb.repeat(1, self.num_planes)
        xb = xb.contiguous()
        out: torch.Tensor
        if self.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(
                xb, self.packed, self.group_size, self.scales_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.packed, self.group_size, self.scales_zeros
            )
        if self.padded_rows != self.rows:
            out = out[:, : self.rows]
        return out.to(x.dtype)

    def widen_min_rows(self) -> int:
        """From this many rows of ``x`` on, a CPU product widens ``W`` (``matmul``)."""
        # The integer loop reads blocks of 32 rows (AVX2's packing); over AVX512's 64 the
        # rounded x goes through the float32 loop, which widening beats as early as ever.
        int8_loop = self.int8_activations and self._block_n == 32
        return WIDEN_MIN_ROWS_INT8_GEMV if int8_loop else _widen_min_rows()

    def _matmul_native(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` by ``gemv_int4.c``, in float32 (CPU, few rows of ``x``). A decode step
        makes a call per matrix, so this one stays lean: a microsecond here is 1-5 % of a
        small matrix's product (SmolLM2's 576 x 576 takes about 20 us)."""
        gemv = native_gemv()
        assert gemv is not None
        buffers = self._buffers  # nn.Module's attribute lookup costs a microsecond a buffer
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        out = gemv(
            cast(torch.Tensor, buffers["packed"]), cast(torch.Tensor, buffers["scales_zeros"]),
            xf, self.padded_rows, self.cols,
            self.num_planes, self.group_size, self._block_n, self._interleaved,
            self.int8_activations,
        )  # fmt: skip
        if self.padded_rows != self.rows:
            out = out[:, : self.rows]
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _matmul_widened(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` through ``W.T`` widened, ``WIDEN_CHUNK_ROWS`` rows of ``W`` at a time
        (CPU, many rows of ``x``): at most one chunk is ever wide."""
        wide = _cpu_gemm_dtype()
        widener = native_widener()
        xw = x.to(wide)
        layout = cpu_layout()
        chunk = max(layout.block_n, WIDEN_CHUNK_ROWS // layout.block_n * layout.block_n)
        outs = []
        for row0 in range(0, self.padded_rows, chunk):
            row1 = min(row0 + chunk, self.padded_rows)
            if widener is not None and row1 - row0 >= layout.block_n:
                whole = (row1 - row0) // layout.block_n * layout.block_n
                w_t = torch.empty(self.cols, row1 - row0, dtype=wide)
                widener(
                    self.packed, self.scales_zeros, self._scale_strides(), w_t, self.cols,
                    self.num_planes, self.group_size, layout.block_n, int(layout.interleaved),
                    row0, row0 + whole,
                )  # fmt: skip
                if whole < row1 - row0:  # a partial last block
                    w_t[:, whole:] = self.take_rows(torch.arange(row0 + whole, row1)).T.to(wide)
                outs.append(xw @ w_t)
            else:
                outs.append(xw @ self.widened_t(wide, row0, row1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out[:, : self.rows].to(x.dtype)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``W[ids]`` ``[len(ids), cols]`` in float32 (an embedding lookup)."""
        if self.device.type == "cuda":
            assert self.row_codes is not None, "call keep_rows() for take_rows on CUDA"
            codes = self.row_codes[ids]
        else:
            codes = cpu_layout().read_rows(
                self.packed, ids, self.padded_rows, self.num_planes * self.cols
            )
        if self.native:  # [blocks, groups, block_n, 2]
            block_n = self.scales_zeros.shape[2]
            sz = self.scales_zeros[ids // block_n, :, ids % block_n].float()  # [T, groups, 2]
        else:
            sz = self.scales_zeros[:, ids].float().transpose(0, 1).contiguous()
        return self._widen(codes, sz[..., 0], sz[..., 1])

    def _scale_strides(self) -> tuple[int, int]:
        """(group, block) strides of ``scales_zeros`` in (scale, zero) pairs."""
        if self.native:
            _, groups, block_n, _ = self.scales_zeros.shape
            return block_n, groups * block_n
        return self.padded_rows, cpu_layout().block_n

    def rows_scales_zeros(self, row0: int, row1: int) -> torch.Tensor:
        """Scales and zeros of rows ``[row0, row1)`` as torch's kernels take them:
        ``[groups, row1 - row0, 2]`` bf16."""
        if not self.native:
            return self.scales_zeros[:, row0:row1]
        _, groups, block_n, _ = self.scales_zeros.shape
        b0, b1 = row0 // block_n, -(-row1 // block_n)
        runs = self.scales_zeros[b0:b1].transpose(0, 1).reshape(groups, (b1 - b0) * block_n, 2)
        return runs[:, row0 - b0 * block_n : row1 - b0 * block_n]

    def widened_t(self, dtype: torch.dtype, row0: int = 0, row1: int | None = None) -> torch.Tensor:
        """Rows ``[row0, row1)`` of ``W`` as ``W.T`` with torch ops: ``[cols, row1 - row0]``
        in ``dtype`` (CPU; ``row0`` a multiple of the layout's block). Unpack, convert,
        scale and shift: about 1.5 ns a weight on one core, against 0.1 for the native
        widener (``native.py``), which this stands in for.

        Planes are summed in float32: Q6_K's top plane scales by 4096 d and its zero
        cancels most of it, so planes rounded to bf16 one by one would err by 8 d.
        """
        layout = cpu_layout()
        row1 = self.padded_rows if row1 is None else row1
        assert row0 % layout.block_n == 0, row0
        width = self.num_planes * self.cols
        full = (row1 - row0) // layout.block_n
        codes_t = layout.read_full_blocks(self.packed, width, full, row0 // layout.block_n)
        covered = row0 + full * layout.block_n
        if covered < row1:
            tail = torch.arange(covered, row1)
            tail_codes = layout.read_rows(self.packed, tail, self.padded_rows, width)
            codes_t = torch.cat([codes_t, tail_codes.T], dim=1)
        groups = width // self.group_size
        # (c - 8) * s + z as c * s + (z - 8 s), with s and z - 8 s made contiguous (small:
        # a pair per group of 32), then two passes over the codes in ``dtype`` alone: a
        # mixed uint8-by-bf16 addcmul runs 3-10x slower than converting first.
        step = dtype if self.num_planes == 1 else torch.float32
        sz = self.rows_scales_zeros(row0, row1).to(torch.float32)
        scales = sz[..., 0].to(step).unsqueeze(1)  # [groups, 1, rows]
        shifts = (sz[..., 1] - 8 * sz[..., 0]).to(step).unsqueeze(1)
        widened = codes_t.to(step).view(groups, self.group_size, row1 - row0)
        widened.mul_(scales).add_(shifts)
        planes = widened.view(self.num_planes, self.cols, row1 - row0)
        return planes[0] if self.num_planes == 1 else planes.sum(dim=0).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """``W`` ``[rows, cols]`` in float32 (tests, ``--quantization none`` arms)."""
        if self.device.type == "cuda":
            return self.take_rows(torch.arange(self.rows, device=self.device))
        return self.widened_t(torch.float32)[:, : self.rows].T.contiguous()

    def _widen(
        self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
    ) -> torch.Tensor:
        """Codes ``[T, planes * cols]`` with their groups' scales and zeros ``[T, groups]``
        -> ``[T, cols]`` float32, the planes summed: ``c * s + (z - 8 s)`` in one pass."""
        count = codes.shape[0]
        shifts = torch.addcmul(zeros, scales, scales.new_full((), -8.0))
        grouped = codes.view(count, -1, self.group_size).to(torch.float32)
        weights = torch.addcmul(shifts.unsqueeze(-1), grouped, scales.unsqueeze(-1))
        if self.num_planes == 1:
            return weights.view(count, self.cols)
        return weights.view(count, self.num_planes, self.cols).sum(dim=1)


#: ``kvflow`` (the default) or ``torch``: whose kernel multiplies few rows by 4-bit weights
#: on the CPU (``use_native_gemv``).
INT4_GEMV_ENV = "KVFLOW_INT4_GEMV"


@cache
def use_native_gemv() -> bool:
    """Whether few-row products go to kvflow's GEMV (``native.py``): it built, the CPU has
    AVX2, and ``KVFLOW_INT4_GEMV`` is not ``torch`` (torch's kernel, the benchmark's other
    arm). With AVX512 the GEMV converts 16 codes an instruction and prefetches the groups
    ahead: on a Xeon it read Llama-3.2-1B's shape at batch 1 1.2x as fast as torch's
    512-bit kernel (docs/benchmarks.md). Weights then keep their scales block-major for it."""
    choice = os.environ.get(INT4_GEMV_ENV, "kvflow")
    if choice not in ("kvflow", "torch"):
        raise ValueError(f"{INT4_GEMV_ENV}={choice!r}: use kvflow or torch")
    return choice == "kvflow" and "avx2" in _cpu_flags() and native_gemv() is not None


#: ``float32`` (the default) or ``int8``: what kvflow's GEMV multiplies the 4-bit codes by.
GEMV_ACTIVATIONS_ENV = "KVFLOW_GEMV_ACTIVATIONS"


@cache
def gemv_activations() -> str:
    """How kvflow's GEMV takes ``x``: ``float32``, exact (the default), or ``int8``, each row
    rounded to int8 in blocks of 32 columns with one scale each (llama.cpp's Q8_0) and
    multiplied by integer dot products: 1.6x the tokens a second at batch 1 where a step is
    its weights' bytes, perplexity +0.29 %, but a near-tie may go the other way (SmolLM2
    answers "What is the capital of France?" with "L'Étoile..." instead of "The capital of
    France is Paris": its first two tokens are 0.09 apart), so it is asked for, as vLLM's
    W4A8 schemes are, not given."""
    value = os.environ.get(GEMV_ACTIVATIONS_ENV, "float32")
    if value not in ("int8", "float32"):
        raise ValueError(f"{GEMV_ACTIVATIONS_ENV}={value!r}: use int8 or float32")
    return value


@cache
def _widen_min_rows() -> int:
    amx = native_widener() is not None and "amx_bf16" in _cpu_flags()
    return WIDEN_MIN_ROWS_AMX if amx else WIDEN_MIN_ROWS


def _block_major(scales_zeros: torch.Tensor, block_n: int) -> torch.Tensor:
    """``[groups, rows, 2]`` -> ``[blocks, groups, block_n, 2]``, rows padded with zeros to
    whole blocks (a partial last block of codes reads only its own rows' scales)."""
    groups, rows, _ = scales_zeros.shape
    blocks = -(-rows // block_n)
    padded = scales_zeros.new_zeros(groups, blocks * block_n, 2)
    padded[:, :rows] = scales_zeros
    return padded.view(groups, blocks, block_n, 2).transpose(0, 1).contiguous()


@cache
def _cpu_gemm_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (about 4x float32's GEMMs with AMX or
    AVX512-BF16); float32 elsewhere, where bf16 GEMMs are emulated."""
    from kvflow.engine_worker.auto_dtype import CPU_BF16_FLAGS

    return torch.bfloat16 if CPU_BF16_FLAGS & _cpu_flags() else torch.float32


@cache
def _cpu_flags() -> frozenset[str]:
    from pathlib import Path

    from kvflow.engine_worker.auto_dtype import cpu_flags

    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def _pack_cuda(codes: torch.Tensor) -> torch.Tensor:
    """tinygemm's layout: two codes a byte, the even column in the high nibble, then
    ``_convert_weight_to_int4pack`` with the widest inner K tiling that divides K."""
    width = codes.shape[1]
    pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).contiguous()
    inner = next(t for t in (8, 4, 2) if width % (t * 16) == 0)
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack(pairs, inner)
    return packed
