"""A process pool whose workers end with the process that started them.

A killed run (a timeout's SIGKILL, a closed terminal) gives its pool no chance to shut
down: a plain ProcessPoolExecutor's workers, reparented, go on computing the cells they
hold, a core each, for results nobody will read (two such held a core for an hour). Here
each worker watches its parent and exits once it is gone.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor

# How often a worker checks that its parent lives: the longest an orphan computes.
PARENT_POLL_S = 0.5


def _exit_with(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # reparented: the run is gone, and so is whoever waited for this cell

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def process_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` worker processes that exit when this process does, however it ends."""
    return ProcessPoolExecutor(max_workers=jobs, initializer=_exit_with, initargs=(os.getpid(),))
