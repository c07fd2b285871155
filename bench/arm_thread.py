"""The thread a benchmark arm runs in: as a worker steps its engine (engine_loop) and
transformers' manager runs its loop. Under load, torch in the main thread spins on OpenMP
barriers (engine_throughput.py's tiny engine: 10-12 tok/s there, 119-130 in a thread, load
3.5)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_thread(fn: Callable[[], T], name: str = "arm") -> T:
    """``fn()`` run in a thread of its own named ``name``; what it raised is raised here."""
    box: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]
