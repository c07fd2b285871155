"""The engine's C kernels, compiled on first use with the machine's C compiler and loaded by
ctypes (``quant/native.py``: int4 products; ``elementwise.py``: norms and RoPE).

Each is optional: where no compiler runs (``$CC``, else ``cc``), or
``KVFLOW_NATIVE_KERNELS=0``, ``build_library`` gives None and the caller uses torch's ops
for the same result. This is how Triton builds its launchers: a small C file, a compiler at
run time, a cache keyed by everything that shapes the binary (the source, the compiler and
its flags, the CPU's flags for ``-march=native``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from kvflow.engine_worker.cache_dir import cache_dir

log = logging.getLogger(__name__)

NATIVE_ENV = "KVFLOW_NATIVE_KERNELS"
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
_COMPILE_TIMEOUT_S = 120.0


def native_enabled() -> bool:
    """False where ``KVFLOW_NATIVE_KERNELS=0`` turns the C kernels off."""
    return os.environ.get(NATIVE_ENV, "1") != "0"


def build_library(
    source_path: Path, extra_flags: tuple[str, ...] = (), without: str = "torch's ops run instead"
) -> ctypes.CDLL | None:
    """``source_path`` compiled (once per source, compiler, flags and CPU) and loaded, or
    None with a warning that says what runs ``without`` it."""
    if not native_enabled():
        return None
    compiler = os.environ.get("CC", "cc")
    name = source_path.stem
    flags = (*_FLAGS, *extra_flags)
    key = hashlib.sha256(source_path.read_bytes())
    for part in (compiler, *flags, _cpu_flags()):
        key.update(part.encode())
    target = cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:24]}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".so")
            os.close(fd)
            try:
                subprocess.run(
                    [compiler, *flags, "-o", tmp, str(source_path)],
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
                "no native %s (%s: %s%s): %s; install a C compiler (gcc) to get it",
                name,
                compiler,
                err,
                f"; {detail.decode(errors='replace').strip()[:300]}" if detail else "",
                without,
            )
            return None
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        log.warning("could not load %s (%s): %s", target, err, without)
        return None


def one_openmp_runtime() -> bool:
    """Whether this process maps a single ``libgomp``: torch's, which a kernel built with
    ``-fopenmp`` then shares (it links ``libgomp.so.1`` by soname), one pool of threads.
    Where not, the kernels run on one thread rather than start a second pool that fights
    torch's for the cores."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    return len(paths) == 1


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
