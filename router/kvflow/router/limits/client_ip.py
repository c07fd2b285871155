"""Who the client is: the peer address, or, behind trusted proxies, the right-most address
in X-Forwarded-For that no trusted proxy wrote. Pure.

Each proxy appends the address it received the request from, so the entries a client can
forge are all left of the ones trusted proxies wrote. Walking from the right past trusted
proxies stops at the first address a trusted proxy vouched for but does not own: the
client. X-Forwarded-For from a peer that is not a trusted proxy is ignored entirely:
anyone can send the header.

IPv6 clients are counted per /64: one subscriber usually holds a whole /64 and can pick a
fresh address in it for every request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from kvflow.router.limits.levels import Network

IPV6_CLIENT_PREFIX_LEN = 64
UNKNOWN_CLIENT = "unknown"  # no peer address (a Unix socket, an in-process test client)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _parse(text: str) -> Address | None:
    """An address as proxies write it: ``1.2.3.4``, ``1.2.3.4:5678``, ``::1``, ``[::1]:80``."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_trusted(address: Address, trusted: Sequence[Network]) -> bool:
    return any(address.version == n.version and address in n for n in trusted)


def client_key(address: Address) -> str:
    """The key a client's limits are counted under."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX_LEN), strict=False))
    return str(address)


def client_address(
    peer: str | None, forwarded_for: Iterable[str], trusted: Sequence[Network]
) -> str:
    """The key of the client behind ``peer``. ``forwarded_for``: every X-Forwarded-For header
    value, in the order received (several headers read as one comma-joined list)."""
    peer_address = _parse(peer) if peer else None
    if peer_address is None:
        return UNKNOWN_CLIENT
    if not _is_trusted(peer_address, trusted):
        return client_key(peer_address)
    hops = [hop for value in forwarded_for for hop in value.split(",") if hop.strip()]
    closest = peer_address  # the nearest address known to be genuine so far
    for hop in reversed(hops):
        address = _parse(hop)
        if address is None:
            # Garbage that a trusted proxy passed on: nothing left of it can be believed, so
            # the client is the last hop a trusted proxy vouched for.
            break
        closest = address
        if not _is_trusted(address, trusted):
            break
    return client_key(closest)
