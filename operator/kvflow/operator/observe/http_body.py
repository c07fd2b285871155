"""A whole HTTP response body, up to a cap (I/O only).

``response.content.read(n)`` is not "read the body": aiohttp's ``StreamReader.read(n)``
returns what has arrived, at most ``n`` bytes, so a body that comes in several TCP
segments was cut after the first. A router's /metrics (about 40 kB with its pools'
histograms) then failed to parse at random, and the planner counted a healthy gateway as
down (seen in tests/gateway/test_gateway_pools.py about once in ten runs).
"""

from __future__ import annotations

import aiohttp

CHUNK_BYTES = 64 << 10


async def read_body(response: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """Every byte of ``response``'s body, or None once it passes ``max_bytes``."""
    data = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        data += chunk
        if len(data) > max_bytes:
            return None
    return bytes(data)
