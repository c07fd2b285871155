"""The sending (prefill) side of the KV TCP transport: it connects to a decode worker's KV
port (through the peer allow-list, and TLS when set), keeps a few idle connections per
receiver for later transfers, and streams a transfer's blocks over one (tcp.py describes
the protocol).

Every wait on the receiver (the connect, its accept, its final ack) runs in slices of
POLL_S and stops once the blocks are revoked, as the payload stream does: a receiver that
accepted the connection and then says nothing holds a send thread until the engine
cancels the send, not until the transfer's deadline (tens of seconds)."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    PeerUnreachableError,
    SendTarget,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.peers import PeerAllowList, resolve_peer
from kvflow.engine_worker.kv_transfer.tcp_auth import (
    MAC_BYTES,
    NONCE_BYTES,
    PayloadMac,
    is_valid,
    receiver_mac,
    sender_mac,
)
from kvflow.engine_worker.kv_transfer.tcp_stream import FAULT_PAUSE_S, POLL_S, PayloadStream
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls, KvTlsError
from kvflow.engine_worker.kv_transfer.tcp_wire import ACCEPT, HEADER, MAGIC, remaining

# A sender keeps this many idle connections per receiver for later transfers (each holds
# a receiver thread): as many as it usually sends to one decode worker at once.
_MAX_KEPT_CONNECTIONS = 4


class _StaleConnectionError(Exception):
    """A kept connection was closed by the receiver before this transfer began."""


def _check(blocks: TransferBlocks, deadline_s: float) -> float:
    """The next wait's length: POLL_S, or less before the deadline. Raises
    TransferCancelledError once ``blocks`` were revoked, TimeoutError at the deadline."""
    if blocks.is_revoked:
        raise TransferCancelledError("the send was cancelled: its blocks were released")
    return min(remaining(deadline_s), POLL_S)


def _recv_exact(
    sock: socket.socket, num_bytes: int, blocks: TransferBlocks, deadline_s: float
) -> bytes:
    """``num_bytes`` from the receiver, waited for in slices (a timed-out recv took nothing;
    under TLS, a record read in part stays in OpenSSL's buffer for the next recv)."""
    data = bytearray()
    while len(data) < num_bytes:
        sock.settimeout(_check(blocks, deadline_s))
        try:
            chunk = sock.recv(num_bytes - len(data))
        except TimeoutError:
            continue
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


def _send_all(sock: socket.socket, data: bytes, blocks: TransferBlocks, deadline_s: float) -> None:
    """sendall in slices: a timed-out send sent nothing (TLS: the same bytes are sent
    again, as OpenSSL asks), so the loop knows what is left, which sendall does not say."""
    view = memoryview(data)
    while view:
        sock.settimeout(_check(blocks, deadline_s))
        try:
            view = view[sock.send(view) :]
        except TimeoutError:
            continue


def _open(host: str, port: int, blocks: TransferBlocks, deadline_s: float) -> socket.socket:
    """A connected socket, as socket.create_connection makes one (each address in turn),
    with the connect polled in slices; its timeout is then the deadline's. Raises OSError
    for the last address's failure."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            code = sock.connect_ex(address)
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            while code in (errno.EINPROGRESS, errno.EAGAIN):
                if poller.poll(_check(blocks, deadline_s) * 1e3):
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code != 0:
                raise OSError(code, os.strerror(code))
            sock.settimeout(remaining(deadline_s))  # blocking again, for the TLS handshake
            return sock
        except OSError as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error or OSError(f"{host} resolves to no address")


class TcpSender:
    def __init__(
        self,
        stream: PayloadStream,
        token: str | None,
        tls: KvTls | None,
        peer_allow: PeerAllowList | None,
    ) -> None:
        self._stream = stream
        self._token = token
        self._tls = tls
        self._peer_allow = peer_allow
        self._kept: dict[str, list[socket.socket]] = {}  # receiver endpoint -> idle
        self._lock = threading.Lock()

    def _connect(self, endpoint: str, blocks: TransferBlocks, deadline_s: float) -> socket.socket:
        host, port = resolve_peer(endpoint, self._peer_allow)
        try:
            sock = _open(host, port, blocks, deadline_s)
        except TimeoutError as exc:
            raise TransferTimeoutError(f"connecting to {endpoint} timed out") from exc
        except OSError as exc:
            raise PeerUnreachableError(
                f"cannot reach the decode worker at {endpoint}: {exc}"
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is None:
            return sock
        try:
            return self._tls.connect(sock, host)
        except TimeoutError as exc:
            sock.close()
            raise TransferTimeoutError(f"the TLS handshake with {endpoint} timed out") from exc
        except (KvTlsError, OSError) as exc:
            sock.close()
            raise TransferRejectedError(
                f"no KV goes to {endpoint}: {exc} (its certificate is not signed by the pool's "
                f"CA or does not name {self._tls.server_name or host}, or it runs no KV TLS)"
            ) from exc

    def send(self, target: SendTarget, blocks: TransferBlocks, timeout_s: float) -> None:
        """Over a connection kept from an earlier transfer to the same receiver if there
        is one (no connect, no new receiver thread, its TCP windows already open), else a
        new one. A kept connection the receiver has meanwhile closed fails at the header
        or the accept byte: the transfer then starts over on a new connection."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            kept = self._kept.get(target.endpoint)
            sock = kept.pop() if kept else None
        if sock is not None:
            try:
                self._send_on(sock, target, blocks, deadline, is_kept=True)
                return
            except _StaleConnectionError:
                pass  # closed by the receiver meanwhile: start over on a new connection
        sock = self._connect(target.endpoint, blocks, deadline)
        self._send_on(sock, target, blocks, deadline)

    def _send_on(
        self,
        sock: socket.socket,
        target: SendTarget,
        blocks: TransferBlocks,
        deadline: float,
        *,
        is_kept: bool = False,
    ) -> None:
        tid = target.transfer_id.encode()
        token = self._token
        try:
            nonce = os.urandom(NONCE_BYTES)
            try:
                mac = sender_mac(token, tid, blocks.num_bytes, nonce)
                header = HEADER.pack(MAGIC, len(tid), blocks.num_bytes, nonce, mac)
                _send_all(sock, header + tid, blocks, deadline)
                answer = _recv_exact(sock, 1 + MAC_BYTES, blocks, deadline)
            except (OSError, ConnectionError) as exc:
                if is_kept and not isinstance(exc, TimeoutError):
                    raise _StaleConnectionError from exc
                raise
            if answer[:1] != ACCEPT:
                raise TransferRejectedError(
                    f"{target.endpoint} does not expect transfer {target.transfer_id} "
                    f"of {blocks.num_bytes} bytes (it gave up, the KV layouts differ, or the "
                    "workers' tokens differ)"
                )
            if not is_valid(token, answer[1:], receiver_mac(token, tid, blocks.num_bytes, nonce)):
                raise TransferRejectedError(
                    f"{target.endpoint} did not prove the pool's worker token: no KV is sent "
                    "there (a reservation named an endpoint outside the pool, or the workers' "
                    "tokens differ)"
                )
            pause_at = blocks.num_bytes // 2 if FAULT_PAUSE_S > 0 else None
            payload_mac = PayloadMac(token, tid, blocks.num_bytes, nonce)
            self._stream.stream(sock, blocks, write=True, deadline_s=deadline, mac=payload_mac,
                         pause_at=pause_at)  # fmt: skip
            _send_all(sock, payload_mac.digest(), blocks, deadline)
            if _recv_exact(sock, 1, blocks, deadline) != ACCEPT:
                raise TransferRejectedError(
                    f"{target.endpoint} refused the payload (it gave up meanwhile, or the "
                    "payload did not match its mac)"
                )
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise TransferTimeoutError(f"sending to {target.endpoint} timed out") from exc
            if isinstance(exc, OSError | ConnectionError):
                raise KvTransferError(f"the KV stream to {target.endpoint} broke: {exc}") from exc
            raise
        with self._lock:
            kept_list = self._kept.setdefault(target.endpoint, [])
            if len(kept_list) < _MAX_KEPT_CONNECTIONS:
                kept_list.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            for socks in self._kept.values():
                for sock in socks:
                    sock.close()
            self._kept.clear()
