"""KV blocks over a plain TCP stream: the transport that works everywhere.

The decode worker listens on its KV port. A sender connects once per transfer (about
0.1 ms on a LAN, well inside the 2 ms setup budget) or reuses a kept connection, writes a
header, waits for the receiver to accept, streams the payload and its MAC, then waits for
a final ack:

    sender:   "KVF4" | id length (u16) | payload bytes (u64) | nonce (16) | mac (32) | id
    receiver: 0x01 accept | its proof (32)   (or 0x00 and zeros: unknown id, a size
              mismatch or a bad mac)
    sender:   payload: the blocks' run stream (blocks.py) | payload mac (32)
    receiver: 0x01 stored (or 0x00: the payload mac is wrong, or the receiver gave up)

With a CPU cache the payload goes from the sender's cache to the socket and from the
socket into the receiver's cache by vectored I/O (vectored.py): no gather, no scatter, no
staging, the same two kernel copies as a plain socket blast. Otherwise (a CUDA cache) each
16 MiB message is gathered into a host buffer, sent, received into one and scattered. The
blocks are touched one socket call at a time, inside their access lock.

With the pool's worker token set (``KVFLOW_WORKER_TOKEN``, as for worker gRPC) the three
macs prove the token both ways and cover every payload byte (tcp_auth.py): without the
token nobody can write into reserved KV blocks, receive KV, or alter it on the way.
Without a token the macs are zeros and are not checked.

With worker TLS files (``--tls-cert-file/--tls-key-file/--tls-ca-file``) the connection runs
mutual TLS first (tcp_tls.py): the receiver requires a certificate the pool's CA signed,
the sender checks the receiver's, and KV crosses the network encrypted. The protocol above
runs unchanged inside it; the payload then goes by ``send``/``recv_into`` per run
(vectored.py, ``step_buffered``) rather than by writev/readv, which would bypass TLS.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch

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
from kvflow.engine_worker.kv_transfer.staging import MESSAGE_BYTES, StagingPool
from kvflow.engine_worker.kv_transfer.tcp_auth import (
    MAC_BYTES,
    NO_MAC,
    NONCE_BYTES,
    PayloadMac,
    is_valid,
    receiver_mac,
    sender_mac,
)
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls, KvTlsError
from kvflow.engine_worker.kv_transfer.vectored import IoVecCursor
from kvflow.proto.transports import KvTransport

log = logging.getLogger(__name__)

# KVF3 proved only the sender, with a mac of the id and size; KVF2 had no mac; KVF1
# carried one contiguous tensor per transfer.
_MAGIC = b"KVF4"
_HEADER = struct.Struct(f"!4sHQ{NONCE_BYTES}s{MAC_BYTES}s")
_ACCEPT, _REJECT = b"\x01", b"\x00"
# A receiver re-checks for cancellation this often while a payload streams in.
_POLL_S = 0.02
# Socket buffers are left to the kernel's autotuning: a fixed SO_SNDBUF/SO_RCVBUF turns it
# off, and a fixed 4 MiB measured no faster than autotuning on loopback
# (docs/benchmarks.md, "KV transfer").
# Fault injection for tests only: pause this long after sending half of every payload, so
# a test can kill a worker mid-transfer. Never set in production.
_FAULT_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_KV_SEND_PAUSE_S", "0"))


# A sender keeps this many idle connections per receiver for later transfers (each holds
# a receiver thread): as many as it usually sends to one decode worker at once.
_MAX_KEPT_CONNECTIONS = 4


class _StaleConnectionError(Exception):
    """A kept connection was closed by the receiver before this transfer began."""


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, without a copy (CPU and contiguous)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


@dataclass(eq=False)
class _Slot:
    blocks: TransferBlocks  # where the payload lands
    done: threading.Event = field(default_factory=threading.Event)
    error: KvTransferError | None = None
    is_abandoned: bool = False  # the receiver gave up: a late payload is refused


def _recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


def _pump(
    sock: socket.socket,
    cursor: IoVecCursor,
    guard: Callable[[], AbstractContextManager[object]],
    *,
    write: bool,
    deadline_s: float,
    should_stop: Callable[[], bool],
    pause_at: int | None = None,
) -> None:
    """Move the cursor's bytes through the non-blocking ``sock``, each call inside
    ``guard()``, waiting for the socket outside it. Raises ConnectionError once
    ``should_stop``, TimeoutError at the deadline."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if write else select.POLLIN)
    while not cursor.is_done:
        if should_stop():
            raise ConnectionError("the receiver gave up")
        if pause_at is not None and cursor.num_done >= pause_at:
            time.sleep(_FAULT_PAUSE_S)
            pause_at = None
        limit = None if pause_at is None else pause_at - cursor.num_done
        with guard():
            if isinstance(sock, ssl.SSLSocket):
                moved = cursor.step_buffered(sock, write=write, max_bytes=limit)
            else:
                moved = cursor.step(sock.fileno(), write=write, max_bytes=limit)
        if moved == 0:
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                raise TimeoutError
            poller.poll(min(left_s, _POLL_S) * 1e3)


def _buffer_cursor(buffer: torch.Tensor, num_bytes: int) -> IoVecCursor:
    return IoVecCursor(np.array([[buffer.data_ptr(), num_bytes]], dtype=np.uint64))


class TcpTransport:
    kind = KvTransport.TCP

    def __init__(
        self,
        host: str,
        port: int,
        advertise_host: str,
        *,
        is_in_place: bool = True,
        token: str | None = None,
        peer_allow: PeerAllowList | None = None,
        tls: KvTls | None = None,
    ) -> None:
        """``is_in_place=False`` stages CPU caches through host buffers too, as a CUDA cache
        must (tests and the benchmark use it to exercise and measure that path). ``token``:
        the pool's worker token, proven both ways (module docstring). ``peer_allow``: the
        networks this worker sends to (None: any; peers.py). ``tls``: mutual TLS on every
        connection, both ways (None: plaintext)."""
        self._token = token
        self._tls = tls
        self._peer_allow = peer_allow
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"{advertise_host}:{self.port}"
        self.is_in_place = is_in_place
        self.pool = StagingPool()
        self.message_bytes = MESSAGE_BYTES  # staged path only; tests make it small
        self._slots: dict[str, _Slot] = {}
        self._kept: dict[str, list[socket.socket]] = {}  # sender: receiver endpoint -> idle
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp", daemon=True)
        self._acceptor.start()

    def _stream(
        self,
        sock: socket.socket,
        blocks: TransferBlocks,
        *,
        write: bool,
        deadline_s: float,
        mac: PayloadMac,
        should_stop: Callable[[], bool] = lambda: False,
        pause_at: int | None = None,
    ) -> None:
        """The payload, in place or staged message by message, fed to ``mac`` in stream
        order (in place: from the cache once it has all moved)."""
        sock.setblocking(False)
        if self.is_in_place and blocks.device.type == "cpu":
            cursor = IoVecCursor(blocks.iovecs())
            _pump(sock, cursor, blocks.access, write=write, deadline_s=deadline_s,
                  should_stop=should_stop, pause_at=pause_at)  # fmt: skip
            mac.update_iovecs(blocks.iovecs(), blocks.access)
            return
        messages = blocks.messages(self.message_bytes)
        staging = self.pool.take(messages[0][1] * blocks.run_bytes, torch.device("cpu"))
        for first, num_runs in messages:
            size = num_runs * blocks.run_bytes
            if write:
                with blocks.access():
                    blocks.read(first, num_runs, staging)
                mac.update(byte_view(staging)[:size])
            cursor = _buffer_cursor(staging, size)
            _pump(sock, cursor, contextlib.nullcontext, write=write, deadline_s=deadline_s,
                  should_stop=should_stop, pause_at=pause_at)  # fmt: skip
            pause_at = None
            if not write:
                mac.update(byte_view(staging)[:size])
                with blocks.access():
                    blocks.write(first, num_runs, staging)
        self.pool.give(staging)  # not after a failure: the socket may still hold it

    # -- receiving (decode side) -----------------------------------------------------------

    def expect(self, transfer_id: str, tag: int, blocks: TransferBlocks) -> None:
        with self._lock:
            self._slots[transfer_id] = _Slot(blocks)

    def receive(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        with self._lock:
            slot = self._slots[transfer_id]
        try:
            while not slot.done.wait(_POLL_S):
                if cancel.is_set():
                    raise TransferCancelledError(f"transfer {transfer_id} cancelled")
                if time.monotonic() >= deadline_s:
                    raise TransferTimeoutError(f"transfer {transfer_id}: no KV before the deadline")
            if slot.error is not None:
                raise slot.error
        finally:
            with self._lock:
                slot.is_abandoned = True
                self._slots.pop(transfer_id, None)

    def wake(self, transfer_id: str) -> None:
        pass  # receive looks at its cancel event every _POLL_S

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Transfers over one connection, one after another, until the sender closes it
        (it keeps connections for later transfers) or a transfer fails or is refused."""
        if self._tls is not None:
            try:
                conn = self._tls.accept(conn)
            except (KvTlsError, OSError) as exc:
                # Before any header is read: no transfer is touched. (Under TLS 1.3 a
                # refused sender may already have written its encrypted header; it is
                # never read.)
                log.warning("refused a KV connection: %s", exc)
                conn.close()
                return
        with conn:
            try:
                while self._serve_one(conn):
                    pass
            except (OSError, ConnectionError, struct.error):
                pass  # the sender went away between transfers

    def _serve_one(self, conn: socket.socket) -> bool:
        """One transfer; False when the connection should close."""
        conn.settimeout(None)  # between transfers the connection idles
        header = _recv_exact(conn, _HEADER.size)
        conn.settimeout(10.0)
        slot: _Slot | None = None
        try:
            magic, id_len, num_bytes, nonce, mac = _HEADER.unpack(header)
            if magic != _MAGIC:
                return False
            raw_id = _recv_exact(conn, id_len)
            token = self._token
            if not is_valid(token, mac, sender_mac(token, raw_id, num_bytes, nonce)):
                log.warning("refused a KV transfer without a valid worker token mac")
                conn.sendall(_REJECT + NO_MAC)
                return False
            transfer_id = raw_id.decode()
            with self._lock:
                slot = self._slots.get(transfer_id)
            if slot is None or slot.is_abandoned or slot.blocks.num_bytes != num_bytes:
                conn.sendall(_REJECT + NO_MAC)
                return False
            conn.sendall(_ACCEPT + receiver_mac(token, raw_id, num_bytes, nonce))
            # No deadline here: a quiet sender is waited for as long as the receiver
            # waits (its deadline, or a cancel, marks the slot abandoned).
            abandoned = slot
            payload_mac = PayloadMac(token, raw_id, num_bytes, nonce)
            self._stream(
                conn,
                slot.blocks,
                write=False,
                deadline_s=float("inf"),
                mac=payload_mac,
                should_stop=lambda: abandoned.is_abandoned,
            )
            conn.settimeout(10.0)
            if not is_valid(token, _recv_exact(conn, MAC_BYTES), payload_mac.digest()):
                # Nothing has read the blocks: the engine hears of a failed transfer and
                # computes the prompt into them itself.
                log.warning("refused KV transfer %s: its payload does not match its mac "
                            "(altered on the way)", transfer_id)  # fmt: skip
                raise TransferRejectedError(
                    f"transfer {transfer_id}: the payload does not match its mac"
                )
            with self._lock:
                is_kept = not slot.is_abandoned
                if is_kept:
                    slot.done.set()
            conn.sendall(_ACCEPT if is_kept else _REJECT)
            return is_kept
        except (OSError, ConnectionError, struct.error, KvTransferError) as exc:
            if slot is not None and not slot.done.is_set():
                slot.error = (
                    exc
                    if isinstance(exc, TransferRejectedError)
                    else KvTransferError(f"the KV stream broke: {exc}")
                )
                slot.done.set()
            with contextlib.suppress(OSError):  # tell a sender waiting for the ack
                if isinstance(exc, TransferRejectedError):
                    conn.sendall(_REJECT)
            return False

    # -- sending (prefill side) ------------------------------------------------------------

    def _connect(self, endpoint: str, deadline_s: float) -> socket.socket:
        host, port = resolve_peer(endpoint, self._peer_allow)
        try:
            sock = socket.create_connection((host, port), timeout=_remaining(deadline_s))
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
        self._send_on(self._connect(target.endpoint, deadline), target, blocks, deadline)

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
                sock.settimeout(_remaining(deadline))
                mac = sender_mac(token, tid, blocks.num_bytes, nonce)
                header = _HEADER.pack(_MAGIC, len(tid), blocks.num_bytes, nonce, mac)
                sock.sendall(header + tid)
                answer = _recv_exact(sock, 1 + MAC_BYTES)
            except (OSError, ConnectionError) as exc:
                if is_kept and not isinstance(exc, TimeoutError):
                    raise _StaleConnectionError from exc
                raise
            if answer[:1] != _ACCEPT:
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
            pause_at = blocks.num_bytes // 2 if _FAULT_PAUSE_S > 0 else None
            payload_mac = PayloadMac(token, tid, blocks.num_bytes, nonce)
            self._stream(sock, blocks, write=True, deadline_s=deadline, mac=payload_mac,
                         pause_at=pause_at)  # fmt: skip
            sock.settimeout(_remaining(deadline))
            sock.sendall(payload_mac.digest())
            if _recv_exact(sock, 1) != _ACCEPT:
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
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for socks in self._kept.values():
                for sock in socks:
                    sock.close()
            self._kept.clear()


def _remaining(deadline_s: float) -> float:
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
