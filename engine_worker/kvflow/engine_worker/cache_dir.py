"""Where a worker keeps what it can rebuild: dequantized models, compiled kernels.

``$KVFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvflow``, else ``~/.cache/kvflow``. Everything
in it is an optimisation: a read-only or missing directory only costs time.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "KVFLOW_CACHE_DIR"


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvflow"
