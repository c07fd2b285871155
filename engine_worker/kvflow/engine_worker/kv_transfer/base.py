"""The transport contract: one decode-side receive, one prefill-side send, typed failures.

Both calls block (they run on the agent's transfer threads, never the engine thread or
the event loop) and either complete with every byte in place or raise a KvTransferError.
They move TransferBlocks (blocks.py): runs of the paged cache itself, read and written in
place inside the blocks' access lock. A receive writes only into the reserved blocks it is
given, which nothing reads until the engine hears the transfer completed; a failed or
cancelled one is revoked first (nothing touches the blocks afterwards), so partial KV
is never read and never lands in blocks that another request owns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvflow.proto.transports import KvTransport

if TYPE_CHECKING:
    from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks


class KvTransferError(Exception):
    """A transfer did not complete; ``kind`` names why, for metrics and status codes."""

    kind = "failed"


class PeerUnreachableError(KvTransferError):
    """The other worker could not be reached (down, wrong address, not listening)."""

    kind = "unreachable"


class TransferTimeoutError(KvTransferError):
    kind = "timeout"


class TransferCancelledError(KvTransferError):
    """The receiver stopped waiting (the router cancelled, or the request was aborted)."""

    kind = "cancelled"


class TransferRejectedError(KvTransferError):
    """The peer refused the transfer: unknown id (already given up), or a layout mismatch."""

    kind = "rejected"


@dataclass(frozen=True, slots=True)
class SendTarget:
    """Where a prefill worker sends: copied from the decode worker's reservation."""

    transfer_id: str
    endpoint: str  # host:port
    tag: int
    decode_instance_id: str


class Transport(Protocol):
    kind: KvTransport
    endpoint: str  # host:port peers send to (the receiver or the rendezvous store)

    def expect(self, transfer_id: str, tag: int, blocks: TransferBlocks) -> None:
        """Register a transfer a sender may deliver into ``blocks`` from now on. Called
        before the reservation leaves this worker, so a fast sender always finds it."""
        ...

    def receive(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        """Block until the expected blocks hold the transfer, or raise: TransferTimeoutError
        at ``deadline_s`` (time.monotonic), TransferCancelledError once ``cancel`` is set, or
        another KvTransferError. Either way the transfer is forgotten afterwards."""
        ...

    def wake(self, transfer_id: str) -> None:
        """Cut short a ``receive`` that is still waiting for its sender (``cancel`` is set
        first): it raises TransferCancelledError now rather than at its next look."""
        ...

    def send(self, target: SendTarget, blocks: TransferBlocks, timeout_s: float) -> None:
        """Deliver ``blocks`` to the receiver of ``target`` or raise (TransferCancelledError
        once they were revoked)."""
        ...

    def close(self) -> None: ...


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise PeerUnreachableError(f"bad KV endpoint {endpoint!r}: expected host:port")
    return host.strip("[]"), int(port)
