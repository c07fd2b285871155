"""The receiving (decode) side of the KV TCP transport: it listens on the KV port, serves each
sender's connection on a thread of its own, one transfer after another, and lands each
payload in the blocks a transfer id was expected into (tcp.py describes the protocol)."""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp_auth import (
    MAC_BYTES,
    NO_MAC,
    PayloadMac,
    is_valid,
    receiver_mac,
    sender_mac,
)
from kvflow.engine_worker.kv_transfer.tcp_stream import POLL_S, PayloadStream
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls, KvTlsError
from kvflow.engine_worker.kv_transfer.tcp_wire import ACCEPT, HEADER, MAGIC, REJECT, recv_exact

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Slot:
    blocks: TransferBlocks  # where the payload lands
    done: threading.Event = field(default_factory=threading.Event)
    error: KvTransferError | None = None
    is_abandoned: bool = False  # the receiver gave up: a late payload is refused


class TcpReceiver:
    def __init__(
        self, host: str, port: int, stream: PayloadStream, token: str | None, tls: KvTls | None
    ) -> None:
        self._stream = stream
        self._token = token
        self._tls = tls
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp", daemon=True)
        self._acceptor.start()

    def expect(self, transfer_id: str, blocks: TransferBlocks) -> None:
        with self._lock:
            self._slots[transfer_id] = _Slot(blocks)

    def receive(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        with self._lock:
            slot = self._slots[transfer_id]
        try:
            while not slot.done.wait(POLL_S):
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

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            # On Linux close() alone does not wake a thread blocked in accept(): the
            # acceptor would stay until the process exits. shutdown() does.
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._acceptor.join(timeout=1.0)

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
        header = recv_exact(conn, HEADER.size)
        conn.settimeout(10.0)
        slot: _Slot | None = None
        try:
            magic, id_len, num_bytes, nonce, mac = HEADER.unpack(header)
            if magic != MAGIC:
                return False
            raw_id = recv_exact(conn, id_len)
            token = self._token
            if not is_valid(token, mac, sender_mac(token, raw_id, num_bytes, nonce)):
                log.warning("refused a KV transfer without a valid worker token mac")
                conn.sendall(REJECT + NO_MAC)
                return False
            transfer_id = raw_id.decode()
            with self._lock:
                slot = self._slots.get(transfer_id)
            if slot is None or slot.is_abandoned or slot.blocks.num_bytes != num_bytes:
                conn.sendall(REJECT + NO_MAC)
                return False
            conn.sendall(ACCEPT + receiver_mac(token, raw_id, num_bytes, nonce))
            # No deadline here: a quiet sender is waited for as long as the receiver
            # waits (its deadline, or a cancel, marks the slot abandoned).
            abandoned = slot
            payload_mac = PayloadMac(token, raw_id, num_bytes, nonce)
            self._stream.stream(
                conn,
                slot.blocks,
                write=False,
                deadline_s=float("inf"),
                mac=payload_mac,
                should_stop=lambda: abandoned.is_abandoned,
            )
            conn.settimeout(10.0)
            if not is_valid(token, recv_exact(conn, MAC_BYTES), payload_mac.digest()):
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
            conn.sendall(ACCEPT if is_kept else REJECT)
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
                    conn.sendall(REJECT)
            return False

    # -- sending (prefill side) ------------------------------------------------------------
