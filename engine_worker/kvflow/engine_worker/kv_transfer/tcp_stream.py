"""The KV TCP payload: a transfer's blocks moved through a non-blocking socket, in place by
vectored I/O from and into a CPU cache, or staged message by message through host buffers
(a CUDA cache, or ``is_in_place=False``), and fed to the payload mac in stream order.

The blocks are touched one socket call at a time, inside their access lock; the socket is
waited for outside it. Under TLS the payload goes by ``send``/``recv_into`` per run
(vectored.py, ``step_buffered``) rather than by writev/readv, which would bypass TLS.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.staging import MESSAGE_BYTES, StagingPool
from kvflow.engine_worker.kv_transfer.tcp_auth import PayloadMac
from kvflow.engine_worker.kv_transfer.vectored import IoVecCursor

# A receiver re-checks for cancellation this often while a payload streams in.
POLL_S = 0.02
# Socket buffers are left to the kernel's autotuning: a fixed SO_SNDBUF/SO_RCVBUF turns it
# off, and a fixed 4 MiB measured no faster than autotuning on loopback
# (docs/benchmarks.md, "KV transfer").
# Fault injection for tests only: pause this long after sending half of every payload, so
# a test can kill a worker mid-transfer. Never set in production.
FAULT_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_KV_SEND_PAUSE_S", "0"))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, without a copy (CPU and contiguous)."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


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
            time.sleep(FAULT_PAUSE_S)
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
            poller.poll(min(left_s, POLL_S) * 1e3)


def _buffer_cursor(buffer: torch.Tensor, num_bytes: int) -> IoVecCursor:
    return IoVecCursor(np.array([[buffer.data_ptr(), num_bytes]], dtype=np.uint64))


@dataclass
class PayloadStream:
    """How one transport moves payloads; its sender and receiver share it."""

    # False stages CPU caches through host buffers too, as a CUDA cache must (tests and
    # the benchmark use it to exercise and measure that path).
    is_in_place: bool = True
    pool: StagingPool = field(default_factory=StagingPool)
    message_bytes: int = MESSAGE_BYTES  # staged path only; tests make it small

    def stream(
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
