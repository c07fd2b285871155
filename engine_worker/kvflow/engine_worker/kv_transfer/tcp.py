"""KV blocks over a plain TCP stream: the transport that works everywhere.

The decode worker listens on its KV port (tcp_receiver.py). A sender (tcp_sender.py)
connects once per transfer (about 0.1 ms on a LAN, well inside the 2 ms setup budget) or
reuses a kept connection, writes a header, waits for the receiver to accept, streams the
payload and its MAC, then waits for a final ack (the framing: tcp_wire.py).

With a CPU cache the payload goes from the sender's cache to the socket and from the
socket into the receiver's cache by vectored I/O (vectored.py): no gather, no scatter, no
staging, the same two kernel copies as a plain socket blast. Otherwise (a CUDA cache) each
16 MiB message is gathered into a host buffer, sent, received into one and scattered
(tcp_stream.py).

With the pool's worker token set (``KVFLOW_WORKER_TOKEN``, as for worker gRPC) the three
macs prove the token both ways and cover every payload byte (tcp_auth.py): without the
token nobody can write into reserved KV blocks, receive KV, or alter it on the way.
Without a token the macs are zeros and are not checked.

With worker TLS files (``--tls-cert-file/--tls-key-file/--tls-ca-file``) the connection runs
mutual TLS first (tcp_tls.py): the receiver requires a certificate the pool's CA signed,
the sender checks the receiver's, and KV crosses the network encrypted. The protocol
runs unchanged inside it.
"""

from __future__ import annotations

import threading

from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.peers import PeerAllowList
from kvflow.engine_worker.kv_transfer.staging import StagingPool
from kvflow.engine_worker.kv_transfer.tcp_receiver import TcpReceiver
from kvflow.engine_worker.kv_transfer.tcp_sender import TcpSender
from kvflow.engine_worker.kv_transfer.tcp_stream import PayloadStream
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls
from kvflow.proto.transports import KvTransport


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
        self._stream = PayloadStream(is_in_place=is_in_place)
        self._receiver = TcpReceiver(host, port, self._stream, token, tls)
        self._sender = TcpSender(self._stream, token, tls, peer_allow)
        self.port = self._receiver.port
        self.endpoint = f"{advertise_host}:{self.port}"

    # Settings of the payload stream that tests and the benchmark change on a live transport.
    @property
    def is_in_place(self) -> bool:
        return self._stream.is_in_place

    @is_in_place.setter
    def is_in_place(self, value: bool) -> None:
        self._stream.is_in_place = value

    @property
    def message_bytes(self) -> int:
        """The staged path's message size; tests make it small."""
        return self._stream.message_bytes

    @message_bytes.setter
    def message_bytes(self, value: int) -> None:
        self._stream.message_bytes = value

    @property
    def pool(self) -> StagingPool:
        return self._stream.pool

    def expect(self, transfer_id: str, tag: int, blocks: TransferBlocks) -> None:
        self._receiver.expect(transfer_id, blocks)

    def receive(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        self._receiver.receive(transfer_id, deadline_s, cancel)

    def wake(self, transfer_id: str) -> None:
        pass  # receive looks at its cancel event every tcp_stream.POLL_S

    def send(self, target: SendTarget, blocks: TransferBlocks, timeout_s: float) -> None:
        self._sender.send(target, blocks, timeout_s)

    def close(self) -> None:
        self._receiver.close()
        self._sender.close()
