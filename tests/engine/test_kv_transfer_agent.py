"""KV transfers between two agents in one process, over the real transports on loopback:
TCP in place (vectored I/O into the caches), TCP staged (as a CUDA cache would) and gloo
(several pipelined messages); and the cancel contract: once ``cancel`` returns, nothing
reads or writes the request's blocks any more."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, SendStats, make_transport
from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    SendTarget,
    TransferCancelledError,
    TransferTimeoutError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.proto.transports import KvTransport

LAYERS, HEADS, POOL, BS, DIM = 3, 2, 40, 4, 8  # runs (blocks) of 256 bytes, 12 runs a layer
RUN_BYTES = BS * 2 * HEADS * DIM * 2
SRC_IDS = [31, 2, 3, 4, 17, 9, 38, 0, 12, 13, 14, 25]
DST_IDS = [5, 6, 7, 39, 21, 22, 1, 30, 10, 11, 36, 8]


def caches(seed: int, pool: int = POOL) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(num_blocks=pool, block_size=BS, num_kv_heads=HEADS, head_dim=DIM)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def picked(kv_caches: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [kv[ids].clone() for kv in kv_caches]


def agent(kind: KvTransport, name: str) -> KvTransferAgent:
    transport = make_transport(
        kind, host="127.0.0.1", port=0, advertise_host="127.0.0.1", instance_id=name
    )
    return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)


class Outcome:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = "pending"

    def __call__(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def wait(self) -> Any:
        assert self.event.wait(20), "no completion"
        return self.value


@pytest.fixture(params=["tcp", "tcp-staged", "gloo"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KvTransferAgent, KvTransferAgent]]:
    kind = KvTransport.GLOO if request.param == "gloo" else KvTransport.TCP
    agents = (agent(kind, "prefill-a"), agent(kind, "decode-b"))
    for a in agents:
        # Messages of 5 runs (1280 bytes): 8 of them, two or three per layer, straddling layers.
        a.transport.message_bytes = 5 * RUN_BYTES  # type: ignore[attr-defined]
        if request.param == "tcp-staged":
            a.transport.is_in_place = False  # type: ignore[attr-defined]
    yield agents
    for a in agents:
        a.close()


def transfer(sender: KvTransferAgent, receiver: KvTransferAgent, src: Any, dst: Any) -> Any:
    received, sent = Outcome(), Outcome()
    ticket = receiver.receive("d1", TransferBlocks.in_cache(dst, DST_IDS), 10.0, received)
    target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode-b")
    sender.send("p1", target, TransferBlocks.in_cache(src, SRC_IDS), 10.0, sent)
    return received.wait(), sent.wait()


def test_blocks_land_in_the_reserved_blocks_and_nowhere_else(
    pair: tuple[KvTransferAgent, KvTransferAgent],
) -> None:
    src = caches(1)
    others = [b for b in range(POOL) if b not in DST_IDS]
    for seed in (2, 3):  # the second reuses the pair (and, staged, the pooled buffers)
        dst = caches(seed)
        untouched = picked(dst, others)
        error, stats = transfer(*pair, src, dst)
        assert error is None and isinstance(stats, SendStats)
        assert stats.num_bytes == LAYERS * 2 * HEADS * len(SRC_IDS) * BS * DIM * 2
        for got, want in zip(picked(dst, DST_IDS), picked(src, SRC_IDS), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(picked(dst, others), untouched, strict=True):
            assert torch.equal(got, want)


def _connect_and_send_half(endpoint: str, transfer_id: str, payload: bytes) -> socket.socket:
    """A hand-made KVF4 sender (no token) that stops halfway through the payload."""
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    tid = transfer_id.encode()
    header = struct.pack("!4sHQ16s32s", b"KVF4", len(tid), len(payload), bytes(16), bytes(32))
    sock.sendall(header + tid)
    assert sock.recv(33) == b"\x01" + bytes(32)  # accepted; no token: no proof
    sock.sendall(payload[: len(payload) // 2])
    return sock


def test_after_cancel_returns_a_late_payload_never_reaches_the_cache() -> None:
    receiver = agent(KvTransport.TCP, "decode-c")
    try:
        dst = caches(4)
        blocks = TransferBlocks.in_cache(dst, DST_IDS)
        received = Outcome()
        ticket = receiver.receive("d2", blocks, 10.0, received)
        payload = bytes(range(256)) * (blocks.num_bytes // 256)
        first_run = dst[0][DST_IDS[0]].clone()
        sock = _connect_and_send_half(ticket.endpoint, ticket.transfer_id, payload)
        deadline = time.monotonic() + 5
        while torch.equal(dst[0][DST_IDS[0]], first_run) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first half is landing in the reserved blocks
        assert receiver.cancel("d2")
        assert blocks.is_revoked  # at once, not when the transport's threads notice
        assert isinstance(received.wait(), TransferCancelledError)
        snapshot = [kv.clone() for kv in dst]
        with sock:
            try:
                sock.sendall(payload[len(payload) // 2 :])
                sock.settimeout(5)
                assert sock.recv(1) in (b"", b"\x00")  # refused or closed, never stored
            except OSError:
                pass  # closed by the receiver mid-send: as good
        time.sleep(0.2)
        for got, want in zip(dst, snapshot, strict=True):  # bitwise: the bytes make NaNs
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        receiver.close()


def test_a_send_cancelled_mid_stream_stops_reading_and_says_so() -> None:
    """The receiver accepts and then reads nothing, so the sender stalls once the socket
    buffers are full (about 8 MiB); cancelling the send revokes its blocks and the send
    fails at once, with TransferCancelledError."""
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn((2, 2, 512, 16, 128), generator=gen).to(torch.bfloat16)] * 2  # 16 MiB
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sender = KvTransferAgent(
        TcpTransport("127.0.0.1", 0, "127.0.0.1"), instance_id="prefill-d", max_timeout_s=30
    )

    release = threading.Event()

    def stall() -> None:
        conn, _ = listener.accept()
        conn.recv(128)  # the header
        conn.sendall(b"\x01" + bytes(32))  # accepted (no token: no proof)
        release.wait(5)
        conn.close()

    thread = threading.Thread(target=stall)
    thread.start()
    try:
        sent = Outcome()
        port = listener.getsockname()[1]
        target = SendTarget("x-1", f"127.0.0.1:{port}", 1, "decode-d")
        blocks = TransferBlocks.in_cache(src, list(range(512)))
        sender.send("p2", target, blocks, 10.0, sent)
        time.sleep(0.3)
        started = time.monotonic()
        assert sender.cancel("p2")
        assert blocks.is_revoked
        assert isinstance(sent.wait(), KvTransferError)
        assert time.monotonic() - started < 1.0  # not when the stalled peer lets go
        assert isinstance(sent.value, TransferCancelledError)
    finally:
        release.set()
        thread.join()
        listener.close()
        sender.close()


def test_a_gloo_receive_waiting_for_its_sender_ends_at_its_deadline_or_at_once_on_cancel() -> None:
    receiver = agent(KvTransport.GLOO, "decode-e")
    try:
        late = Outcome()
        started = time.monotonic()
        receiver.receive("d3", TransferBlocks.in_cache(caches(6), DST_IDS), 0.3, late)
        assert isinstance(late.wait(), TransferTimeoutError)
        assert 0.3 <= time.monotonic() - started < 2.0
        cancelled = Outcome()
        receiver.receive("d4", TransferBlocks.in_cache(caches(7), DST_IDS), 20.0, cancelled)
        time.sleep(0.1)
        started = time.monotonic()
        assert receiver.cancel("d4")
        assert isinstance(cancelled.wait(), TransferCancelledError)
        while receiver.num_active and time.monotonic() - started < 5.0:
            time.sleep(0.01)
        assert receiver.num_active == 0  # its thread was woken, not left until the deadline
        assert time.monotonic() - started < 1.0
    finally:
        receiver.close()


def test_a_sender_reuses_its_connection_and_survives_one_the_receiver_closed() -> None:
    """A hand-made receiver serves one transfer per connection and then closes it: the
    sender's kept connection is stale at the second transfer, which starts over on a new
    connection; the first receiver keeps its connection for the next transfer."""
    src = caches(8)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def serve_once_per_connection() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            accepted.append(1)
            with conn:
                magic, id_len, num_bytes, *_ = struct.unpack("!4sHQ16s32s", _recv(conn, 62))
                assert magic == b"KVF4"
                _recv(conn, id_len)
                conn.sendall(b"\x01" + bytes(32))  # accepted (no token: no proof)
                _recv(conn, num_bytes + 32)  # the payload and its mac
                conn.sendall(b"\x01")

    thread = threading.Thread(target=serve_once_per_connection)
    thread.start()
    sender = agent(KvTransport.TCP, "prefill-f")
    try:
        target = SendTarget("x-2", f"127.0.0.1:{listener.getsockname()[1]}", 1, "decode-f")
        for request_id in ("p5", "p6"):
            sent = Outcome()
            sender.send(request_id, target, TransferBlocks.in_cache(src, SRC_IDS), 10.0, sent)
            assert isinstance(sent.wait(), SendStats), sent.value
        assert len(accepted) == 2
    finally:
        thread.join(10)
        listener.close()
        sender.close()


def test_a_receiver_serves_several_transfers_on_one_connection() -> None:
    sender, receiver = (
        agent(KvTransport.TCP, "prefill-g"),
        agent(KvTransport.TCP, "decode-g"),
    )
    try:
        src = caches(9)
        for seed in (10, 11, 12):
            dst = caches(seed)
            error, stats = transfer(sender, receiver, src, dst)
            assert error is None and isinstance(stats, SendStats)
            assert torch.equal(dst[1][DST_IDS], src[1][SRC_IDS])
        kept = sender.transport._sender._kept  # type: ignore[attr-defined]
        assert [len(v) for v in kept.values()] == [1]  # one connection, reused
    finally:
        sender.close()
        receiver.close()


def _recv(conn: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        assert chunk
        data += chunk
    return bytes(data)
