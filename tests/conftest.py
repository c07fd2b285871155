"""Settings every test directory shares.

``make test`` runs the tests in parallel (pytest-xdist, one worker per core). Each worker
process, and every server its tests start (they inherit the environment), gets an equal
share of the machine's cores for torch's intra-op threads: two workers each running two
OpenMP threads on two cores stall at every barrier of every op (docs/benchmarks.md,
"Noise": a decode step took 5.4 s under that contention). A thread count set by the caller
is kept.
"""

from __future__ import annotations

import os
import sys

import pytest

_NUM_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _NUM_WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _NUM_WORKERS)
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_THREADS))
    if "torch" in sys.modules:  # imported before this file: its pool is already sized
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# tests/k8s shares one control plane per session and stops it after the folder's last test
# (tests/k8s/conftest.py); its tests run on one worker, in order, as one unit. Every other
# file is a unit of its own (``--dist loadfile``): its module fixtures start once.
ONE_UNIT_FOLDERS = ("tests/k8s/",)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderOrFileScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((f for f in ONE_UNIT_FOLDERS if path.startswith(f)), path)

    return FolderOrFileScheduling(config, log)
