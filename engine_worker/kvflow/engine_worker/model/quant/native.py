"""The int4 C kernels, compiled on first use (``native_build``) and called by ctypes:
``widen_int4.c`` (int4 weights widened for a GEMM, many rows of activations) and
``gemv_int4.c`` (int4 weights times a few rows: decode steps).

Both are optional: where no compiler runs, or ``KVFLOW_NATIVE_KERNELS=0``,
``native_widener()`` and ``native_gemv()`` are None and ``Int4Weight`` uses torch's ops and
kernels for the same result, several times slower.

Threads: the widener splits by row blocks over ``torch.get_num_threads()`` Python threads
(ctypes releases the GIL; a call widens megabytes, so a thread hand-off is cheap beside it).
A decode step's products take tens of microseconds each, which a Python hand-off would
double, so the GEMV threads with OpenMP inside the call: it links ``libgomp.so.1`` by soname,
and in a process where torch has loaded its own ``libgomp.so.1`` the dynamic linker binds it
to that one, so both share one runtime and one pool of threads. ``native_gemv()`` checks that
after loading (a second OpenMP runtime beside torch's would fight it for the cores) and
otherwise runs it on one thread.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from kvflow.engine_worker.model.native_build import build_library, one_openmp_runtime

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_WITHOUT = "quantized weights use torch's int4 ops, several times slower"
# widen_int4.c's fixed buffers.
_MAX_BLOCK_N = 64
_MAX_GROUPS = 4096
#: gemv_int4.c's: rows of x one call takes (``gemv`` splits larger inputs).
GEMV_MAX_ROWS = 12
#: gemv_int4.c's QK: columns of ``x`` that share one int8 scale.
GEMV_INT8_BLOCK = 32

#: ``widen(packed, scales_zeros, scale_strides, out, cols, planes, group, block_n,
#: interleaved, row0, row1)``: rows ``[row0, row1)`` of W, planes summed, as W.T into the
#: first ``row1 - row0`` columns of ``out`` (bf16 or float32, ``[cols, >= row1 - row0]``, rows
#: dense). ``scale_strides``: (group, block) strides of ``scales_zeros`` in (scale, zero)
#: pairs, so it reads torch's layout ``[groups, rows, 2]`` or the GEMV's block-major one.
Widener = Callable[
    [torch.Tensor, torch.Tensor, tuple[int, int], torch.Tensor, int, int, int, int, int, int, int],
    None,
]
#: The GEMV takes the scales and zeros block-major, ``[blocks, groups, block_n, 2]`` bf16
#: (int4_weight.py): a block's scales are one run.
#: ``gemv(packed, scales_zeros, x, padded_rows, cols, planes, group, block_n, interleaved,
#: int8_x)``: ``x [M, cols]`` (float32) ``@ W.T`` -> ``[M, padded_rows]`` float32, every row
#: of W; with ``int8_x``, ``x`` rounded to int8 in blocks of ``GEMV_INT8_BLOCK`` columns
#: (``gemv_int4.c``; ``cols`` a multiple of it).
Gemv = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int, int, int, bool], torch.Tensor
]


@cache
def native_widener() -> Widener | None:
    """The compiled widener, or None (no compiler, a failed build, or turned off)."""
    library = build_library(_HERE / "widen_int4.c", without=_WITHOUT)
    if library is None:
        return None
    function = library.widen_int4
    function.restype = None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    function.argtypes = [ptr, ptr, ptr, i32, i64, i64, i64, i64, i64, i64, i64, i32, i64,
                         i64]  # fmt: skip
    pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()))

    def widen(
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        scale_strides: tuple[int, int],
        out: torch.Tensor,
        cols: int,
        planes: int,
        group: int,
        block_n: int,
        interleaved: int,
        row0: int,
        row1: int,
    ) -> None:
        assert packed.is_contiguous() and scales_zeros.is_contiguous() and out.stride(1) == 1
        assert scales_zeros.dtype == torch.bfloat16 and out.dtype in (torch.bfloat16, torch.float32)
        assert out.shape[0] == cols and out.shape[1] >= row1 - row0
        assert row0 % block_n == 0 and row1 % block_n == 0
        assert block_n <= _MAX_BLOCK_N and planes * cols // group <= _MAX_GROUPS
        blocks = (row1 - row0) // block_n
        parts = max(1, min(torch.get_num_threads(), blocks))
        bounds = [row0 + block_n * (blocks * i // parts) for i in range(parts + 1)]
        args = (packed.data_ptr(), scales_zeros.data_ptr(), out.data_ptr())
        is_f32 = int(out.dtype == torch.float32)

        def run(start: int, end: int) -> None:
            # Each thread writes its own columns of ``out``, from column start - row0 on.
            offset = (start - row0) * out.element_size()
            function(
                args[0], args[1], args[2] + offset, is_f32, out.stride(0), *scale_strides,
                cols, planes, group, block_n, interleaved, start, end,
            )  # fmt: skip

        if parts == 1:
            run(row0, row1)
            return
        for future in [pool.submit(run, s, e) for s, e in itertools.pairwise(bounds)]:
            future.result()

    return widen


@cache
def native_gemv(extra_flags: tuple[str, ...] = ()) -> Gemv | None:
    """The compiled int4 GEMV, or None (no compiler, a failed build, or turned off).
    ``extra_flags``: a build with more compiler flags (the tests' AVX2-only build,
    ``-mno-avx512f``, on an AVX512 CPU)."""
    library = build_library(_HERE / "gemv_int4.c", ("-fopenmp", *extra_flags), without=_WITHOUT)
    if library is None:
        return None
    function = library.gemv_int4
    function.restype = ctypes.c_int32
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    function.argtypes = [ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, i32, i64,
                         i64, i32, i32]  # fmt: skip
    shared = one_openmp_runtime()
    if not shared:
        log.warning(
            "the int4 GEMV kernel loaded an OpenMP runtime beside torch's: it runs on one "
            "thread (set CC to the compiler torch was built with to share torch's)"
        )

    def gemv(
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        x: torch.Tensor,
        padded_rows: int,
        cols: int,
        planes: int,
        group: int,
        block_n: int,
        interleaved: int,
        int8_x: bool,
    ) -> torch.Tensor:
        # A decode step makes some hundred of these calls, each tens of microseconds of
        # kernel: the checks here are on x alone (a few hundred nanoseconds), and W's
        # tensors are the caller's to check once (``check_gemv_weight``).
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != cols or x.stride(1) != 1:
            raise ValueError(f"gemv takes float32 rows of {cols}: {x.dtype} {tuple(x.shape)}")
        if int8_x and cols % GEMV_INT8_BLOCK:
            raise ValueError(f"int8 activations need columns in blocks of {GEMV_INT8_BLOCK}")
        rows_x, x_stride = x.shape[0], x.stride(0)
        out = torch.empty(rows_x, padded_rows, dtype=torch.float32)
        x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
        w_ptr, sz_ptr = packed.data_ptr(), scales_zeros.data_ptr()
        threads = torch.get_num_threads() if shared else 1
        for i in range(0, rows_x, GEMV_MAX_ROWS):
            status = function(
                w_ptr, sz_ptr, x_ptr + 4 * i * x_stride, x_stride, out_ptr + 4 * i * padded_rows,
                padded_rows, min(GEMV_MAX_ROWS, rows_x - i), cols, planes, group, block_n,
                interleaved, 0, padded_rows, threads, int8_x,
            )  # fmt: skip
            if status == -2:
                raise MemoryError("gemv_int4: no memory for the int8 rows of x")
            assert status == 0, f"gemv_int4 refused its arguments ({status})"
        return out

    return gemv


def check_gemv_weight(
    packed: torch.Tensor, scales_zeros: torch.Tensor, cols: int, planes: int, group: int,
    block_n: int,
) -> None:  # fmt: skip
    """What the GEMV reads of W, checked once for every later call: dense bytes, block-major
    bf16 scales, and sizes within its fixed buffers."""
    if not (packed.is_contiguous() and packed.dtype == torch.uint8):
        raise ValueError("the GEMV reads packed codes as dense uint8")
    if not (scales_zeros.is_contiguous() and scales_zeros.dtype == torch.bfloat16):
        raise ValueError("the GEMV reads dense bf16 scales and zeros")
    if scales_zeros.dim() != 4 or scales_zeros.shape[2] != block_n:
        raise ValueError("the GEMV reads scales block-major: [blocks, groups, block_n, 2]")
    if block_n > _MAX_BLOCK_N or planes * cols // group > _MAX_GROUPS:
        raise ValueError(f"the GEMV takes blocks of {_MAX_BLOCK_N} rows and {_MAX_GROUPS} groups")
