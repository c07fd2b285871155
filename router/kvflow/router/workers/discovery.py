"""Where the workers are: a static list, or the A records of a Kubernetes headless Service.

A headless Service's DNS name resolves to one A record per ready pod, so re-resolving it
every few seconds follows scale-ups, restarts and removals without a Kubernetes client.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("kvflow.router.discovery")

DNS_INTERVAL_S = 5.0


class DiscoveryConfigError(ValueError):
    """A worker address or DNS name is malformed; the message shows the expected form."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryConfigError(f"expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def parse_worker_list(text: str) -> list[str]:
    """ "a:1,b:2" -> ["a:1", "b:2"], each checked."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for address in addresses:
        parse_address(address)
    return addresses


@dataclass(frozen=True)
class StaticWorkers:
    addresses: Sequence[str]

    async def run(self, apply: Callable[[list[str]], Awaitable[None]]) -> None:
        await apply(list(self.addresses))


@dataclass(frozen=True)
class DnsWorkers:
    """Re-resolve NAME every ``interval_s``; every A/AAAA record is a worker on PORT."""

    name: str
    port: int
    interval_s: float = DNS_INTERVAL_S

    async def resolve(self) -> list[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        hosts = sorted({str(info[4][0]) for info in infos})
        return [f"[{h}]:{self.port}" if ":" in h else f"{h}:{self.port}" for h in hosts]

    async def run(self, apply: Callable[[list[str]], Awaitable[None]]) -> None:
        last: list[str] | None = None
        while True:
            try:
                addresses = await self.resolve()
            except OSError as exc:
                # Keep the workers we know: a DNS hiccup must not empty the pool.
                log.warning("resolving %s failed (%s); keeping %s", self.name, exc, last)
            else:
                if addresses != last:
                    log.info("%s resolves to %s", self.name, addresses)
                    await apply(addresses)
                    last = addresses
            await asyncio.sleep(self.interval_s)
