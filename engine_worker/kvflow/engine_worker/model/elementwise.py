"""RMSNorm and RoPE over a decode step's few float32 or bf16 rows, one C call each
(``elementwise.c``).

At batch 1 a decode step's layers run about twenty small ops each, and once a layer's
weights have streamed through the caches each op's dispatch costs about 10 us: torch's
RMSNorm is five ops (seven in bf16), RoPE three. Here each is one call. Both functions
return None when the input is not theirs (not float32 or bf16 on the CPU, a layout they do
not read, more than ``MAX_NATIVE_ELEMENTS``, or no compiler: ``native_build``); the caller
then runs torch's ops, which agree to within an ulp or two: in bf16 the kernels round where
torch's ops do (tests/engine/test_elementwise.py).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kvflow.engine_worker.model.native_build import build_library

#: Past this many elements (a prefill chunk, a large batch) torch's ops, which run on every
#: thread, are as fast and the call's saving is nothing beside the step's GEMMs.
MAX_NATIVE_ELEMENTS = 1 << 16


@cache
def _library() -> ctypes.CDLL | None:
    source = Path(__file__).with_name("elementwise.c")
    library = build_library(source, without="norms and RoPE run as torch's ops")
    if library is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rms_norm_f32.restype = None
    library.rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float]
    library.rope_f32.restype = None
    library.rope_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    library.rms_norm_bf16.restype = None
    library.rms_norm_bf16.argtypes = library.rms_norm_f32.argtypes
    library.rope_bf16.restype = None
    library.rope_bf16.argtypes = library.rope_f32.argtypes
    return library


_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether the kernels are built (a C compiler, ``KVFLOW_NATIVE_KERNELS`` not 0)."""
    return _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x [rows, n] / sqrt(mean(x^2) + eps) * weight`` as a new tensor, or None (not
    handled here: see the module docstring). ``weight``: ``[n]``, dense, ``x``'s dtype (a
    norm's parameter).

    A decode step makes some sixty of these calls: the checks are on ``x`` and cheap
    (``Tensor.device`` alone costs a microsecond; ``is_cpu`` a tenth of it)."""
    library = _library()
    if library is None or x.dtype not in _DTYPES or not x.is_cpu or x.dim() != 2:
        return None
    rows, n = x.shape
    if x.stride(1) != 1 or not 0 < rows * n <= MAX_NATIVE_ELEMENTS:
        return None
    if weight.dtype is not x.dtype:
        return None
    assert weight.is_contiguous() and weight.numel() == n
    out = torch.empty(rows, n, dtype=x.dtype)
    norm = library.rms_norm_f32 if x.dtype is torch.float32 else library.rms_norm_bf16
    norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), n, rows,
                         n, eps)  # fmt: skip
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``x [rows, heads, head_dim]`` rotated in place by ``cos`` and signed ``sin`` (``[rows,
    1, head_dim]``, dense, ``x``'s dtype: rope.py's ``Rotation``); returns ``x``, or None
    (not handled here, ``x`` untouched)."""
    library = _library()
    if library is None or x.dtype not in _DTYPES or not x.is_cpu or x.dim() != 3:
        return None
    rows, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or not 0 < x.numel() <= MAX_NATIVE_ELEMENTS:
        return None
    if cos.dtype is not x.dtype or cos.shape != (rows, 1, head_dim):
        return None
    assert cos.is_contiguous() and sin.is_contiguous() and sin.shape == cos.shape
    rope = library.rope_f32 if x.dtype is torch.float32 else library.rope_bf16
    rope(x.data_ptr(), x.stride(0), rows, heads, head_dim, cos.data_ptr(),
                     sin.data_ptr())  # fmt: skip
    return x
