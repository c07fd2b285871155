"""Threads with a large stack, for work that recurses in native code (pure stdlib).

llguidance, which compiles JSON schemas, regexes and grammars for structured output in both
the gateway and the worker, recurses once per link of a reference chain: a flat chain of
`$ref`s or grammar rules, well within the size and depth limits (about 50-90 KB), overflowed
a default 8 MiB thread stack and the process died (SIGSEGV: every request in flight lost).
On a 64 MiB stack the largest input the limits admit (128 KiB chains) compiles in under
0.1 s. The stack is reserved address space, committed only as deep as a call goes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LARGE_STACK_BYTES = 64 << 20
# threading.stack_size is the process's setting for threads started after it: set it
# around one start at a time.
_STACK_SIZE_LOCK = threading.Lock()


class LargeStackThreadPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor whose threads have ``stack_bytes`` of stack."""

    def __init__(self, *args: Any, stack_bytes: int = LARGE_STACK_BYTES, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stack_bytes = stack_bytes

    def _adjust_thread_count(self) -> None:
        # The one place ThreadPoolExecutor starts its threads (CPython 3.8 on).
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(self._stack_bytes)
            try:
                super()._adjust_thread_count()
            finally:
                threading.stack_size(previous)
