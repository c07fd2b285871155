"""The engine loop's side of KV transfers: start them, cancel them, hear how they ended.

Transfers block, so each runs on a thread of its own pool; the engine thread only
registers a receive buffer (before the reservation leaves the worker) or hands over a
gathered copy of the blocks to send, and gets a callback when the transfer is over.
Callbacks run on the transfer thread: they must only post work to the engine loop.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    KvTransportKind,
    SendTarget,
    TransferCancelledError,
    Transport,
)

log = logging.getLogger(__name__)

# Gloo tags are C ints; decode numbers its transfers and wraps well before 2**31.
_MAX_TAG = 2**31 - 1
# A transfer thread is blocked on the network or polling, not computing: 16 at once keeps
# 16 prompts in flight per worker, more than a 2k-token step budget fills at once.
MAX_CONCURRENT_TRANSFERS = 16


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a decode worker tells the router (and, through it, the prefill worker)."""

    transfer_id: str
    tag: int
    endpoint: str
    kind: KvTransportKind
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SendStats:
    num_bytes: int
    transfer_s: float


class _PendingReceive:
    """One receive's way out: ``finish`` calls on_done exactly once, from whichever of the
    transfer thread and a canceller gets there first."""

    def __init__(self, on_done: Callable[[KvTransferError | None], None]) -> None:
        self.cancel = threading.Event()
        self._on_done: Callable[[KvTransferError | None], None] | None = on_done
        self._lock = threading.Lock()

    def finish(self, error: KvTransferError | None) -> None:
        with self._lock:
            on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(error)


class KvTransferAgent:
    def __init__(self, transport: Transport, *, instance_id: str, max_timeout_s: float) -> None:
        self.transport = transport
        self.max_timeout_s = max_timeout_s
        self._instance = instance_id[:12]
        self._numbers = itertools.count(1)
        self._pending: dict[str, _PendingReceive] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_TRANSFERS, thread_name_prefix="kv-xfer")
        self.num_active = 0

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    def _started(self) -> None:
        with self._lock:
            self.num_active += 1

    def _ended(self) -> None:
        with self._lock:
            self.num_active -= 1

    # -- decode side ---------------------------------------------------------------------

    def receive(
        self,
        request_id: str,
        buffer: Any,
        timeout_s: float,
        on_done: Callable[[KvTransferError | None], None],
    ) -> Ticket:
        """Expect a transfer into ``buffer`` and wait for it on a transfer thread; ``on_done``
        gets None when every byte is there, else why not. Returns the ticket to publish."""
        number = next(self._numbers)
        timeout_s = min(timeout_s, self.max_timeout_s) if timeout_s > 0 else self.max_timeout_s
        ticket = Ticket(
            f"{self._instance}-{number}",
            number % _MAX_TAG,
            self.transport.endpoint,
            self.transport.kind,
            timeout_s,
        )
        pending = _PendingReceive(on_done)
        with self._lock:
            self._pending[request_id] = pending
        self.transport.expect(ticket.transfer_id, ticket.tag, buffer)
        deadline_s = time.monotonic() + timeout_s

        def run() -> None:
            error: KvTransferError | None = None
            try:
                self.transport.receive(ticket.transfer_id, deadline_s, pending.cancel)
            except KvTransferError as exc:
                error = exc
            except Exception as exc:  # a transport bug must still free the request
                log.exception("receiving %s failed", ticket.transfer_id)
                error = KvTransferError(str(exc))
            finally:
                with self._lock:
                    self._pending.pop(request_id, None)
                self._ended()
            pending.finish(error)

        self._started()
        self._pool.submit(run)
        return ticket

    def cancel(self, request_id: str) -> bool:
        """Stop waiting for a request's transfer: its on_done reports TransferCancelledError
        now, whether or not the transport's thread can be interrupted (a late payload then
        lands in a buffer nobody reads)."""
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:
            return False
        pending.cancel.set()
        pending.finish(TransferCancelledError(f"the transfer of {request_id} was cancelled"))
        return True

    # -- prefill side --------------------------------------------------------------------

    def send(
        self,
        target: SendTarget,
        data: Any,
        timeout_s: float,
        on_done: Callable[[SendStats | KvTransferError], None],
    ) -> None:
        """Send ``data`` (already a private copy of the blocks) on a transfer thread."""
        timeout_s = min(timeout_s, self.max_timeout_s) if timeout_s > 0 else self.max_timeout_s

        def run() -> None:
            started = time.perf_counter()
            result: SendStats | KvTransferError
            try:
                self.transport.send(target, data, timeout_s)
                num_bytes = data.numel() * data.element_size()
                result = SendStats(num_bytes, time.perf_counter() - started)
            except KvTransferError as exc:
                result = exc
            except Exception as exc:
                log.exception("sending %s failed", target.transfer_id)
                result = KvTransferError(str(exc))
            finally:
                self._ended()
            on_done(result)

        self._started()
        self._pool.submit(run)

    def close(self) -> None:
        for pending in list(self._pending.values()):
            pending.cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def make_transport(
    kind: KvTransportKind, *, host: str, port: int, advertise_host: str, instance_id: str
) -> Transport:
    if kind is KvTransportKind.TCP:
        from kvflow.engine_worker.kv_transfer.tcp import TcpTransport

        return TcpTransport(host, port, advertise_host)
    from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport

    return TorchDistTransport(kind, host, port, advertise_host, instance_id)
