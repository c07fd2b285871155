"""The KV TCP protocol's framing: the header a sender opens a transfer with, the one-byte
answers, and exact reads (tcp.py describes the exchange; tcp_auth.py the macs in it).

    sender:   "KVF4" | id length (u16) | payload bytes (u64) | nonce (16) | mac (32) | id
    receiver: 0x01 accept | its proof (32)   (or 0x00 and zeros: unknown id, a size
              mismatch or a bad mac)
    sender:   payload: the blocks' run stream (blocks.py) | payload mac (32)
    receiver: 0x01 stored (or 0x00: the payload mac is wrong, or the receiver gave up)
"""

from __future__ import annotations

import socket
import struct
import time

from kvflow.engine_worker.kv_transfer.tcp_auth import MAC_BYTES, NONCE_BYTES

# KVF3 proved only the sender, with a mac of the id and size; KVF2 had no mac; KVF1
# carried one contiguous tensor per transfer.
MAGIC = b"KVF4"
HEADER = struct.Struct(f"!4sHQ{NONCE_BYTES}s{MAC_BYTES}s")
ACCEPT, REJECT = b"\x01", b"\x00"


def recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


def remaining(deadline_s: float) -> float:
    """Seconds left until the monotonic ``deadline_s``; TimeoutError once it has passed."""
    left = deadline_s - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
