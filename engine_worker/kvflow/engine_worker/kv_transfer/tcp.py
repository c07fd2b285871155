"""KV blocks over a plain TCP stream: the transport that works everywhere.

The decode worker listens on its KV port. A sender connects once per transfer (about
0.1 ms on a LAN, well inside the 2 ms setup budget) and writes a header, waits for the
receiver to accept the id, streams the payload straight from the tensor's memory into the
receiver's buffer (no intermediate copies in Python), then waits for a final ack:

    sender:   "KVF1" | id length (u16) | payload bytes (u64) | transfer id
    receiver: 0x01 accept (or 0x00 reject: unknown id or a size mismatch)
    sender:   payload
    receiver: 0x01 stored (or 0x00: the receiver gave up meanwhile)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    KvTransportKind,
    PeerUnreachableError,
    SendTarget,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
    split_endpoint,
)

log = logging.getLogger(__name__)

_MAGIC = b"KVF1"
_HEADER = struct.Struct("!4sHQ")
_ACCEPT, _REJECT = b"\x01", b"\x00"
# A receiver re-checks for cancellation this often while a payload streams in.
_POLL_S = 0.02
# 4 MiB socket buffers: a 1 GB/s stream with 2 ms of scheduling jitter needs ~2 MB in flight.
_SOCKET_BUFFER_BYTES = 4 << 20
# Fault injection for tests only: pause this long after sending half of every payload, so
# a test can kill a worker mid-transfer. Never set in production.
_FAULT_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_KV_SEND_PAUSE_S", "0"))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, without a copy (CPU and contiguous)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


@dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor  # where the payload lands (CPU; staged for a CUDA buffer)
    target: torch.Tensor  # the caller's buffer
    done: threading.Event = field(default_factory=threading.Event)
    error: KvTransferError | None = None
    is_abandoned: bool = False  # the receiver gave up: a late payload is refused

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def _recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


class TcpTransport:
    kind = KvTransportKind.TCP

    def __init__(self, host: str, port: int, advertise_host: str) -> None:
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"{advertise_host}:{self.port}"
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp", daemon=True)
        self._acceptor.start()

    # -- receiving (decode side) -----------------------------------------------------------

    def expect(self, transfer_id: str, tag: int, buffer: Any) -> None:
        staged = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
        with self._lock:
            self._slots[transfer_id] = _Slot(staged, buffer)

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
            if slot.target is not slot.buffer:
                slot.target.copy_(slot.buffer)
        finally:
            with self._lock:
                slot.is_abandoned = True
                self._slots.pop(transfer_id, None)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        slot: _Slot | None = None
        with conn:
            try:
                conn.settimeout(10.0)
                magic, id_len, num_bytes = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if magic != _MAGIC:
                    return
                transfer_id = _recv_exact(conn, id_len).decode()
                with self._lock:
                    slot = self._slots.get(transfer_id)
                if slot is None or slot.is_abandoned or slot.num_bytes != num_bytes:
                    conn.sendall(_REJECT)
                    return
                conn.sendall(_ACCEPT)
                self._read_payload(conn, slot)
                with self._lock:
                    is_kept = not slot.is_abandoned
                    if is_kept:
                        slot.done.set()
                conn.sendall(_ACCEPT if is_kept else _REJECT)
            except (OSError, ConnectionError, struct.error) as exc:
                if slot is not None and not slot.done.is_set():
                    slot.error = KvTransferError(f"the KV stream broke: {exc}")
                    slot.done.set()

    def _read_payload(self, conn: socket.socket, slot: _Slot) -> None:
        """Read until the buffer is full. A quiet sender is waited for as long as the
        receiver waits (its deadline, or a cancel, marks the slot abandoned)."""
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)
        conn.settimeout(_POLL_S * 5)
        view = byte_view(slot.buffer)
        received = 0
        while received < len(view):
            if slot.is_abandoned:
                raise ConnectionError("the receiver gave up")
            try:
                n = conn.recv_into(view[received:])
            except TimeoutError:
                continue
            if n == 0:
                raise ConnectionError("the sender closed the stream early")
            received += n

    # -- sending (prefill side) ------------------------------------------------------------

    def send(self, target: SendTarget, data: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        payload = data.contiguous() if data.device.type == "cpu" else data.cpu()
        view = byte_view(payload)
        host, port = split_endpoint(target.endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=max(timeout_s, 0.001))
        except TimeoutError as exc:
            raise TransferTimeoutError(f"connecting to {target.endpoint} timed out") from exc
        except OSError as exc:
            raise PeerUnreachableError(
                f"cannot reach the decode worker at {target.endpoint}: {exc}"
            ) from exc
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
            tid = target.transfer_id.encode()
            try:
                sock.settimeout(_remaining(deadline))
                sock.sendall(_HEADER.pack(_MAGIC, len(tid), len(view)) + tid)
                if _recv_exact(sock, 1) != _ACCEPT:
                    raise TransferRejectedError(
                        f"{target.endpoint} does not expect transfer {target.transfer_id} "
                        f"of {len(view)} bytes (it gave up, or the KV layouts differ)"
                    )
                sock.settimeout(_remaining(deadline))
                if _FAULT_PAUSE_S > 0:
                    half = len(view) // 2
                    sock.sendall(view[:half])
                    time.sleep(_FAULT_PAUSE_S)
                    view = view[half:]
                    sock.settimeout(_remaining(deadline))
                sock.sendall(view)
                sock.settimeout(_remaining(deadline))
                if _recv_exact(sock, 1) != _ACCEPT:
                    raise TransferRejectedError(
                        f"{target.endpoint} gave up on the transfer meanwhile"
                    )
            except TimeoutError as exc:
                raise TransferTimeoutError(f"sending to {target.endpoint} timed out") from exc
            except (OSError, ConnectionError) as exc:
                raise KvTransferError(f"the KV stream to {target.endpoint} broke: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()


def _remaining(deadline_s: float) -> float:
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
