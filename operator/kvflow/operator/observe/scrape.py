"""Read /metrics of a pool's pods (I/O only: fetch text; `exposition` parses it).

All targets of a pool are read at once, each within `timeout_s`: a worker busy with a long
prefill still answers /metrics from its HTTP thread in milliseconds, so a target that
takes seconds is down or unreachable, and the planner goes on without it (its inputs
count only the replicas that answered).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import aiohttp

from kvflow.operator.observe.http_body import read_body

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
# A worker's exposition is about 30 kB (23 buckets x 5 histograms, plus counters).
MAX_BODY_BYTES = 4 << 20


async def fetch_all(urls: Iterable[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, str]:
    """url -> body of every target that answered 200; the others are logged and left out."""
    targets = sorted(set(urls))
    if not targets:
        return {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        bodies = await asyncio.gather(*(_fetch(session, url) for url in targets))
    return {url: body for url, body in zip(targets, bodies, strict=True) if body is not None}


async def _fetch(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                log.warning("scrape %s: HTTP %d", url, response.status)
                return None
            data = await read_body(response, MAX_BODY_BYTES)
            if data is None:
                log.warning("scrape %s: an exposition over %d bytes", url, MAX_BODY_BYTES)
                return None
            return data.decode("utf-8", errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("scrape %s: %s", url, exc or type(exc).__name__)
        return None
