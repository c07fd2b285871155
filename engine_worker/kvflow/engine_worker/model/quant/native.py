"""``widen_int4.c``, compiled on first use with the machine's C compiler and called by ctypes.

The one native piece of the engine, and optional: where no compiler runs (``$CC``, else
``cc``), or ``KVFLOW_NATIVE_KERNELS=0``, ``native_widener()`` is None and ``Int4Weight``
widens with torch ops, 15-20x slower for the same result. This is how Triton builds its
launchers: a small C file, a compiler at run time, a cache keyed by everything that shapes
the binary (the source, the compiler and its flags, the CPU's flags for ``-march=native``).

Threads: the work splits by row blocks over ``torch.get_num_threads()`` Python threads;
ctypes releases the GIL for the call. No OpenMP: a second OpenMP runtime beside torch's
would fight it for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch

from kvflow.engine_worker.cache_dir import cache_dir

log = logging.getLogger(__name__)

NATIVE_ENV = "KVFLOW_NATIVE_KERNELS"
_SOURCE = Path(__file__).with_name("widen_int4.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
_COMPILE_TIMEOUT_S = 120.0
# widen_int4.c's fixed buffers.
_MAX_BLOCK_N = 64
_MAX_GROUPS = 4096

#: ``widen(packed, scales_zeros, out, padded_rows, cols, planes, group, block_n,
#: interleaved, row0, row1)``: rows ``[row0, row1)`` of W, planes summed, as W.T into the
#: first ``row1 - row0`` columns of ``out`` (bf16 or float32, ``[cols, >= row1 - row0]``,
#: rows dense).
Widener = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, int, int, int, int, int, int], None
]


@cache
def native_widener() -> Widener | None:
    """The compiled widener, or None (no compiler, a failed build, or turned off)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    library = _build()
    if library is None:
        return None
    function = library.widen_int4
    function.restype = None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    function.argtypes = [ptr, ptr, ptr, i32, i64, i64, i64, i64, i64, i64, i32, i64, i64]
    pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()))

    def widen(
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out: torch.Tensor,
        padded_rows: int,
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
                args[0], args[1], args[2] + offset, is_f32, out.stride(0), padded_rows, cols,
                planes, group, block_n, interleaved, start, end,
            )  # fmt: skip

        if parts == 1:
            run(row0, row1)
            return
        for future in [pool.submit(run, s, e) for s, e in itertools.pairwise(bounds)]:
            future.result()

    return widen


def _build() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC", "cc")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source)
    for part in (compiler, *_FLAGS, _cpu_flags()):
        key.update(part.encode())
    target = cache_dir() / "kernels" / f"widen_int4-{key.hexdigest()[:24]}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *_FLAGS, "-o", tmp, str(_SOURCE)],
                    check=True,
                    capture_output=True,
                    timeout=_COMPILE_TIMEOUT_S,
                )
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)  # whole or absent, even with two workers building
            finally:
                Path(tmp).unlink(missing_ok=True)
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", b"") or b""
            log.warning(
                "no native int4 widening (%s: %s%s): large batches over quantized weights "
                "widen with torch ops, several times slower; install a C compiler (gcc) to "
                "get it",
                compiler,
                err,
                f"; {detail.decode(errors='replace').strip()[:300]}" if detail else "",
            )
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        log.warning("could not load %s (%s): widening with torch ops", target, err)
        return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
