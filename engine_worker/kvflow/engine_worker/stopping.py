"""How a worker process stops, the generating one (app.py) and the embedding one
(embed/app.py) alike: it waits for SIGTERM (the kubelet) or SIGINT (a terminal), then lets
the requests it is running finish for up to --drain-timeout-s."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

# How often the drain looks at the requests in flight: short against a drain's seconds.
DRAIN_POLL_S = 0.05


def stop_on_signal() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT. Install it before announcing readiness: a
    SIGTERM that arrives between the ready line and the handler would kill the process
    with no drain."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    return stop


async def drain(num_in_flight: Callable[[], int], timeout_s: float) -> None:
    """Return once ``num_in_flight()`` is 0, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
