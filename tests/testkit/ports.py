"""Loopback ports for test servers, drawn from below the kernel's ephemeral range.

A port from `bind(("127.0.0.1", 0))` comes from the ephemeral range, the same range the
kernel draws the local port of every outgoing connection from. A test that picks a port
and starts its server later (or restarts one at the same port, as the chaos soak does)
can find it taken by some client's connection meanwhile, for as long as that connection
lives: a clean-clone CI run lost the short chaos soak to "Address already in use" that
way, after five retries a second apart. Below the ephemeral range only listeners bind,
so a port that is free now stays free until someone asks for it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000  # above the well-known and most registered ports
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # never the same port twice to one test process


def ephemeral_range() -> tuple[int, int]:
    """The kernel's (lowest, highest) local port for outgoing connections."""
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # stricter than loopback: any listener on it refuses
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on now, and that no outgoing connection will take."""
    low, _ = ephemeral_range()
    if low - _LOWEST < 1000:  # a machine whose ephemeral range starts low: the old way
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    rng = random.SystemRandom()  # tests seed `random`; two processes must not draw alike
    for _ in range(200):
        port = rng.randrange(_LOWEST, low)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {_LOWEST}-{low - 1} after 200 draws")
