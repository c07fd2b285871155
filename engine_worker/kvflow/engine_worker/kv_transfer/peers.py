"""Which KV endpoints a worker connects to (``--kv-peer-allow``).

A prefill worker sends wherever a reservation says, and a reservation comes from a gRPC
caller. The worker token keeps KV from going anywhere that cannot prove it (tcp_auth.py,
group_auth.py), but the worker still opens a connection to any host:port it is given. The
allow list keeps even that to the pool's own network: a list of networks (CIDRs, or single
addresses), and an endpoint's host is resolved once, checked against it, and connected to
at the address that was checked (a name that resolves elsewhere later cannot slip past).
Unset, any endpoint is allowed (a laptop, a test).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from kvflow.engine_worker.kv_transfer.base import (
    PeerUnreachableError,
    TransferRejectedError,
    split_endpoint,
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class KvPeerRefusedError(TransferRejectedError):
    """The endpoint is outside ``--kv-peer-allow``: this worker does not connect to it."""

    kind = "refused"


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, text: str | None) -> PeerAllowList | None:
        """``"10.0.0.0/8,fd00::/8"`` (commas or spaces); None or "" allows any endpoint.
        Raises ValueError naming an entry that is not a network or address."""
        entries = (text or "").replace(",", " ").split()
        if not entries:
            return None
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError as exc:
                raise ValueError(
                    f"--kv-peer-allow entry {entry!r} is not a network (CIDR such as "
                    "10.0.0.0/8) or an address"
                ) from exc
        return cls(tuple(networks))

    def allows(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", maxsplit=1)[0])  # an IPv6 scope id is no part
        return any(ip in network for network in self.networks)

    def __str__(self) -> str:
        return ",".join(map(str, self.networks))


def resolve_peer(endpoint: str, allow: PeerAllowList | None) -> tuple[str, int]:
    """The (host, port) to connect to for ``endpoint``: as given when any is allowed, else
    its first resolved address inside the allow list. Raises KvPeerRefusedError when none
    is, PeerUnreachableError when the name does not resolve or the endpoint is malformed."""
    host, port = split_endpoint(endpoint)
    if allow is None:
        return host, port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerUnreachableError(f"cannot resolve the KV endpoint {endpoint}: {exc}") from exc
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        if allow.allows(address):
            return address, port
    raise KvPeerRefusedError(
        f"the KV endpoint {endpoint} ({', '.join(sorted(set(addresses)))}) is outside "
        f"--kv-peer-allow ({allow}): this worker does not connect to it"
    )
