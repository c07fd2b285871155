"""Mutual TLS on the TCP KV port, from the files worker gRPC serves with (tls.py).

Each worker of a pool is both ends: it receives KV as a server (presenting its certificate,
requiring the sender's, signed by the pool's CA) and sends it as a client (presenting the
same certificate, checking the receiver's against the CA and a name). Receivers are dialled
by pod IP, so a certificate issued for a name (cert-manager's ``<pool>-workers.<ns>.svc``,
the name the gateway checks for worker gRPC too) is checked against ``server_name``;
without one, against the address dialled.

TLS keeps KV unreadable on the wire; the worker token's macs (tcp_auth.py) still prove the
pool's token both ways and cover every payload byte, inside the TLS stream, so a worker
of another pool with a certificate from a shared CA is still refused.
"""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

# The handshake of an accepted connection must finish this soon: a peer that connects and
# says nothing (or speaks plaintext) holds a receiver thread no longer.
HANDSHAKE_TIMEOUT_S = 10.0


class KvTlsError(Exception):
    """The TLS handshake failed: a peer without a certificate the CA signed, a name its
    certificate does not carry, or a peer that does not speak TLS."""


@dataclass(frozen=True)
class KvTls:
    server: ssl.SSLContext
    client: ssl.SSLContext
    server_name: str | None = None  # the name receivers' certificates carry; None: the address

    @classmethod
    def from_files(
        cls, cert_file: str, key_file: str, ca_file: str, server_name: str | None = None
    ) -> KvTls:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_file)
        server.verify_mode = ssl.CERT_REQUIRED  # a sender must present a certificate
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        for context in (server, client):
            # Both ends are kvflow workers of one release: no older protocol to talk to.
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.load_cert_chain(cert_file, key_file)
        return cls(server, client, server_name)

    def accept(self, conn: socket.socket) -> ssl.SSLSocket:
        """The receiver's side of the handshake on an accepted connection."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            return self.server.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, ConnectionError) as exc:
            raise KvTlsError(f"TLS handshake refused: {exc}") from exc

    def connect(self, sock: socket.socket, host: str) -> ssl.SSLSocket:
        """The sender's side, on a connected socket (its timeout bounds the handshake)."""
        try:
            return self.client.wrap_socket(sock, server_hostname=self.server_name or host)
        except (ssl.SSLError, ConnectionError) as exc:
            # ConnectionError: the peer hung up on the hello (a receiver without KV TLS).
            raise KvTlsError(f"TLS handshake failed: {exc}") from exc
