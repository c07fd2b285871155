"""The engine loop's side of KV transfers: start them, cancel them, hear how they ended.

Transfers block, so each runs on a transfer thread; the engine thread only hands over the
request's blocks (TransferBlocks: read and written in place, no copy on the engine thread)
and gets a callback when the transfer is over. The agent revokes the blocks before any
callback, and ``cancel`` revokes them before it returns: once the engine hears of the end
of a transfer, or has cancelled it, no transfer thread touches those blocks again and the
engine may free or overwrite them. Callbacks run on the transfer thread: they must only
post work to the engine loop.

Receives and sends have pools of their own. A receive holds its thread from the reservation
until the payload lands, the whole time the prefill worker queues and computes the prompt
(seconds under load), so every receive gets a thread at once: the engine's seats bound how
many can wait (app.py passes ``max_num_seqs``). A send holds its thread only from connect
to ack, and 16 run at once; one stuck on a dead receiver never holds up a receive.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    SendTarget,
    TransferCancelledError,
    Transport,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.peers import PeerAllowList
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls
from kvflow.proto.transports import KvTransport

log = logging.getLogger(__name__)

# Decode numbers its transfers and wraps at 2**20: gloo tags are C ints, and torch_dist
# puts a message index in the 11 bits above (a million transfers apart, never concurrent).
_MAX_TAG = 2**20
# A send's thread is blocked on the network, not computing, and only once the prompt is
# computed: 16 at once keeps 16 prompts' KV in flight per worker, more than a 2k-token step
# budget fills at once.
MAX_CONCURRENT_SENDS = 16
# Receives wait far longer (module docstring): one pool of 16 for both kinds stalled a decode
# worker's 17th receive, even one whose KV had landed, until one of the first 16 ended. Their
# pool is sized to the receives that can be pending (the worker's max_num_seqs; this default
# when no engine says): a thread starts only when no idle one is left, so a large bound
# costs nothing until receives need it.
DEFAULT_MAX_RECEIVES = 256


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a decode worker tells the router (and, through it, the prefill worker)."""

    transfer_id: str
    tag: int
    endpoint: str
    kind: KvTransport
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SendStats:
    num_bytes: int
    transfer_s: float


class _PendingReceive:
    """One receive's way out: ``finish`` calls on_done exactly once, from whichever of the
    transfer thread and a canceller gets there first."""

    def __init__(
        self,
        transfer_id: str,
        blocks: TransferBlocks,
        on_done: Callable[[KvTransferError | None], None],
    ) -> None:
        self.transfer_id = transfer_id
        self.blocks = blocks
        self.cancel = threading.Event()
        self._on_done: Callable[[KvTransferError | None], None] | None = on_done
        self._lock = threading.Lock()

    def finish(self, error: KvTransferError | None) -> None:
        with self._lock:
            on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(error)


class KvTransferAgent:
    def __init__(
        self,
        transport: Transport,
        *,
        instance_id: str,
        max_timeout_s: float,
        max_receives: int = DEFAULT_MAX_RECEIVES,
    ) -> None:
        """``max_receives``: the most receives that can be pending at once (the engine's
        max_num_seqs); each gets a thread as soon as it starts."""
        self.transport = transport
        self.max_timeout_s = max_timeout_s
        self._instance = instance_id[:12]
        self._numbers = itertools.count(1)
        self._pending: dict[str, _PendingReceive] = {}
        self._sending: dict[str, TransferBlocks] = {}
        self._lock = threading.Lock()
        self._receives = ThreadPoolExecutor(max_receives, thread_name_prefix="kv-recv")
        self._sends = ThreadPoolExecutor(MAX_CONCURRENT_SENDS, thread_name_prefix="kv-send")
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
        blocks: TransferBlocks,
        timeout_s: float,
        on_done: Callable[[KvTransferError | None], None],
    ) -> Ticket:
        """Expect a transfer into ``blocks`` and wait for it on a transfer thread; ``on_done``
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
        pending = _PendingReceive(ticket.transfer_id, blocks, on_done)
        with self._lock:
            self._pending[request_id] = pending
        self.transport.expect(ticket.transfer_id, ticket.tag, blocks)
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
                blocks.revoke()  # the transport's threads are done with them
                with self._lock:
                    self._pending.pop(request_id, None)
                self._ended()
            pending.finish(error)

        self._started()
        self._receives.submit(run)
        return ticket

    def cancel(self, request_id: str) -> bool:
        """End a request's transfer, either way: when this returns, no transfer thread
        touches its blocks any more (it waits for a piece of I/O in progress, a few ms at
        most). A receive's on_done reports TransferCancelledError now, whether or not the
        transport's thread can be interrupted (a late payload lands in a staging buffer
        nobody reads); a send fails with it at its next piece. False if none was running."""
        with self._lock:
            pending = self._pending.get(request_id)
            sending = self._sending.get(request_id)
        if sending is not None:
            sending.revoke()
        if pending is None:
            return sending is not None
        pending.cancel.set()
        self.transport.wake(pending.transfer_id)
        pending.blocks.revoke()
        pending.finish(TransferCancelledError(f"the transfer of {request_id} was cancelled"))
        return True

    # -- prefill side --------------------------------------------------------------------

    def send(
        self,
        request_id: str,
        target: SendTarget,
        blocks: TransferBlocks,
        timeout_s: float,
        on_done: Callable[[SendStats | KvTransferError], None],
    ) -> None:
        """Send ``blocks`` on a send thread (after the sends before it, once 16 run). The
        request must hold them (unchanged) until on_done, or until ``cancel`` returned."""
        timeout_s = min(timeout_s, self.max_timeout_s) if timeout_s > 0 else self.max_timeout_s
        with self._lock:
            self._sending[request_id] = blocks

        def run() -> None:
            started = time.perf_counter()
            result: SendStats | KvTransferError
            try:
                self.transport.send(target, blocks, timeout_s)
                result = SendStats(blocks.num_bytes, time.perf_counter() - started)
            except KvTransferError as exc:
                result = exc
            except Exception as exc:
                log.exception("sending %s failed", target.transfer_id)
                result = KvTransferError(str(exc))
            finally:
                blocks.revoke()
                with self._lock:
                    if self._sending.get(request_id) is blocks:
                        del self._sending[request_id]
                self._ended()
            on_done(result)

        self._started()
        self._sends.submit(run)

    def close(self) -> None:
        for pending in list(self._pending.values()):
            pending.cancel.set()
            self.transport.wake(pending.transfer_id)
            pending.blocks.revoke()
        for blocks in list(self._sending.values()):
            blocks.revoke()
        self._receives.shutdown(wait=False, cancel_futures=True)
        self._sends.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


def make_transport(
    kind: KvTransport,
    *,
    host: str,
    port: int,
    advertise_host: str,
    instance_id: str,
    peer_allow: PeerAllowList | None = None,
    tls: KvTls | None = None,
) -> Transport:
    """The transport of ``kind``; ``tls`` covers the tcp one (gloo and nccl carry KV in
    plaintext: their groups take no TLS)."""
    from kvflow.engine_worker.auth import TOKEN_ENV, token_from_env

    token = token_from_env()
    if token is None:
        log.warning(
            "the KV port (%s) is unauthenticated: anyone who reaches it can write into "
            "reserved KV blocks, and KV goes to whatever endpoint a reservation names; set "
            "%s (the pool's worker token) on every worker of the pool",
            kind.value,
            TOKEN_ENV,
        )
    return _FACTORIES[kind](
        _TransportSpec(kind, host, port, advertise_host, instance_id, token, peer_allow, tls)
    )


@dataclass(frozen=True)
class _TransportSpec:
    kind: KvTransport
    host: str
    port: int
    advertise_host: str
    instance_id: str
    token: str | None
    peer_allow: PeerAllowList | None
    tls: KvTls | None


def _tcp(spec: _TransportSpec) -> Transport:
    from kvflow.engine_worker.kv_transfer.tcp import TcpTransport

    log.info("the KV port (tcp) runs %s", "mutual TLS" if spec.tls else "plaintext")
    return TcpTransport(spec.host, spec.port, spec.advertise_host, token=spec.token,
                        peer_allow=spec.peer_allow, tls=spec.tls)  # fmt: skip


def _torch_dist(spec: _TransportSpec) -> Transport:
    if spec.tls is not None:
        log.warning("KV over %s is not encrypted: only the tcp transport runs TLS", spec.kind)
    from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport

    return TorchDistTransport(spec.kind, spec.host, spec.port, spec.advertise_host,
                              spec.instance_id, token=spec.token,
                              peer_allow=spec.peer_allow)  # fmt: skip


# Every shared KvTransport has its builder here (tests/contracts/test_transports.py); the
# torch.distributed ones are imported on first use, so a tcp worker never loads them.
_FACTORIES: dict[KvTransport, Callable[[_TransportSpec], Transport]] = {
    KvTransport.TCP: _tcp,
    KvTransport.GLOO: _torch_dist,
    KvTransport.NCCL: _torch_dist,
}
