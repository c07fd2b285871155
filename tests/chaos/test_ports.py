"""The ports test servers get: below the kernel's ephemeral range, so that no outgoing
connection can take one between the draw and the server's bind (or its restart)."""

from __future__ import annotations

import socket

import pytest
from testkit import ports
from testkit.ports import ephemeral_range, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    low, high = ephemeral_range()
    assert 1024 <= low < high
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= p < low for p in ports)


def test_a_port_someone_listens_on_is_not_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    # The draw is made to land on a port a listener holds (one this process never drew),
    # twice, before a free one: the free one is what comes back.
    busy, fresh = free_port(), free_port()
    ports._handed_out -= {busy, fresh}  # as if another process had drawn them
    listener = socket.socket()
    listener.bind(("127.0.0.1", busy))
    listener.listen()
    draws = iter([busy, busy, fresh])

    class Scripted:
        def randrange(self, start: int, stop: int) -> int:
            return next(draws)

    monkeypatch.setattr(ports.random, "SystemRandom", Scripted)
    try:
        assert ports.free_port() == fresh
    finally:
        listener.close()


def test_many_outgoing_connections_never_sit_on_a_drawn_port() -> None:
    # The failure this guards against: a client's local port is the port a server is
    # about to bind. Open many connections, and check none of their local ports is below
    # the ephemeral range, where `free_port` draws.
    low, _ = ephemeral_range()
    server = socket.socket()
    server.bind(("127.0.0.1", free_port()))
    server.listen(256)
    clients = []
    try:
        for _ in range(100):
            clients.append(socket.create_connection(server.getsockname()))
        assert all(c.getsockname()[1] >= low for c in clients)
    finally:
        for c in clients:
            c.close()
        server.close()
