"""bf16 ``x @ W.T`` for a decode step's few rows, one C call (``gemv_bf16.c``).

A bf16 model's batch-1 step is mostly its products, and torch's bf16 linear at one row
reads small matrices (SmolLM2's are 0.6-3.5 MB) at about half the streamed bandwidth; the
kernel prefetches the rows ahead and reads them about 1.3x as fast (docs/benchmarks.md,
"bf16 products at a decode step's few rows"). It needs AVX512-BF16 (``vdpbf16ps``): a
CPU with native bf16, where ``auto`` picks bf16 for a bf16 checkpoint.

``linear`` returns None when the call is not the kernel's (not bf16 on the CPU, more than
``MAX_ROWS`` rows, a layout it does not read, no compiler or no AVX512-BF16:
``native_build``); the caller then runs torch's ops. Both sum in float32 and round once to
bf16, in different orders (tests/engine/test_dense_gemv.py bounds the difference).
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from kvflow.engine_worker.model.native_build import build_library, one_openmp_runtime

log = logging.getLogger(__name__)

#: gemv_bf16.c's ROWS_X. Past it torch's bf16 GEMM is faster than the kernel's passes.
MAX_ROWS = 4


class _Kernel:
    """The loaded library and how many threads its calls may use."""

    def __init__(self, library: ctypes.CDLL, shared_openmp: bool) -> None:
        self.function = library.gemv_bf16
        self.shared_openmp = shared_openmp


@cache
def _kernel(extra_flags: tuple[str, ...] = ()) -> _Kernel | None:
    library = build_library(
        Path(__file__).with_name("gemv_bf16.c"),
        ("-fopenmp", *extra_flags),
        without="bf16 products run as torch's linear",
    )
    if library is None or not library.gemv_bf16_available():
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    function = library.gemv_bf16
    function.restype = i32
    function.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i32]
    shared = one_openmp_runtime()
    if not shared:
        log.warning(
            "the bf16 GEMV kernel loaded an OpenMP runtime beside torch's: it runs on one "
            "thread (set CC to the compiler torch was built with to share torch's)"
        )
    assert library.gemv_bf16_max_rows() == MAX_ROWS
    return _Kernel(library, shared)


def available(extra_flags: tuple[str, ...] = ()) -> bool:
    """Whether the kernel runs here: a C compiler, AVX512-BF16, native kernels not off."""
    return _kernel(extra_flags) is not None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    extra_flags: tuple[str, ...] = (),
) -> torch.Tensor | None:
    """``x @ weight.T (+ bias) (+ residual)``, bf16 ``[rows, out]``, rounded once; or None
    (not the kernel's: see the module docstring). ``x``: ``[rows, in]`` bf16; ``weight``:
    ``[out, in]`` bf16, rows dense; ``bias``: ``[out]``; ``residual``: ``[rows, out]``.

    A decode step makes some hundred of these calls, tens of microseconds each: the checks
    are the cheap attributes only. ``extra_flags``: a build with more compiler flags (the
    tests and the benchmark's arms)."""
    if x.dtype is not torch.bfloat16 or not x.is_cpu or x.dim() != 2:
        return None
    rows, cols = x.shape
    if not 0 < rows <= MAX_ROWS or x.stride(1) != 1:
        return None
    if weight.dtype is not torch.bfloat16 or weight.stride(1) != 1 or weight.shape[1] != cols:
        return None
    kernel = _kernel(extra_flags)
    if kernel is None:
        return None
    out_features = weight.shape[0]
    if bias is not None and not (bias.dtype is torch.bfloat16 and bias.is_contiguous()):
        return None
    if residual is not None and (
        residual.dtype is not torch.bfloat16
        or residual.shape != (rows, out_features)
        or residual.stride(1) != 1
    ):
        return None
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    threads = torch.get_num_threads() if kernel.shared_openmp else 1
    status = kernel.function(
        weight.data_ptr(), weight.stride(0), out_features, cols, x.data_ptr(), x.stride(0), rows,
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(), out.stride(0), threads,
    )  # fmt: skip
    assert status == 0, f"gemv_bf16 refused its arguments ({status})"
    return out
