"""The TCP KV port with the pool's worker token proves both ends and every payload byte
(kv_transfer/tcp_auth.py).

Real TCP transports on loopback. A relay between them alters one payload byte: the
receiver refuses the transfer before it reports the blocks landed, the sender hears the
refusal, both free the transfer, and the next one (not altered) lands. A receiver that
cannot prove the token (an endpoint outside the pool) gets the header and not one byte of
KV.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import pytest
import torch
from testkit.kv_pair import Outcome, cache

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    SendTarget,
    TransferRejectedError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.proto.transports import KvTransport

IDS = [3, 1, 4, 9]
TOKEN = "s3cret"
HEADER_BYTES = 4 + 2 + 8 + 16 + 32


def agent(name: str, token: str | None, *, in_place: bool = True) -> KvTransferAgent:
    transport = TcpTransport("127.0.0.1", 0, "127.0.0.1", token=token, is_in_place=in_place)
    transport.message_bytes = 1024  # staged: several messages per transfer
    return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)


class FlippingRelay:
    """Relays one connection to ``upstream``, flipping the sender's byte at ``offset``."""

    def __init__(self, upstream: str, offset: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._upstream = upstream
        self._offset = offset
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        down, _ = self.listener.accept()
        host, port = self._upstream.rsplit(":", 1)
        up = socket.create_connection((host, int(port)))
        threading.Thread(target=self._pipe, args=(up, down, None), daemon=True).start()
        self._pipe(down, up, self._offset)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                data = bytearray(chunk)
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0x40
                seen += len(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_an_altered_payload_is_refused_and_the_transfer_fails_cleanly(in_place: bool) -> None:
    receiver, sender = agent("decode", TOKEN, in_place=in_place), agent("prefill", TOKEN)
    try:
        src, dst = cache(1), cache(2)
        received = Outcome()
        ticket = receiver.receive("d1", TransferBlocks.in_cache(dst, IDS), 10.0, received)
        tid = ticket.transfer_id.encode()
        relay = FlippingRelay(ticket.endpoint, HEADER_BYTES + len(tid) + 1000)
        target = SendTarget(ticket.transfer_id, relay.endpoint, ticket.tag, "decode")
        sent = Outcome()
        sender.send("p1", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
        assert isinstance(sent.wait(), TransferRejectedError)
        assert "did not match its mac" in str(sent.value)
        error = received.wait()
        assert isinstance(error, KvTransferError) and "does not match its mac" in str(error)
        relay.close()
        # Both sides let go of the transfer; the next one, not altered, lands.
        assert receiver.num_active == 0 and sender.num_active == 0
        received = Outcome()
        ticket = receiver.receive("d2", TransferBlocks.in_cache(dst, IDS), 10.0, received)
        target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode")
        sent = Outcome()
        sender.send("p2", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
        assert received.wait() is None and not isinstance(sent.wait(), Exception)
        for got, want in zip(dst, src, strict=True):
            assert torch.equal(got[IDS], want[IDS])
    finally:
        receiver.close()
        sender.close()


def test_no_kv_goes_to_an_endpoint_that_cannot_prove_the_token() -> None:
    """A listener that accepts everything, as a port outside the pool might (or a worker
    without the token): it gets the header and the transfer is refused by the sender."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = bytearray()

    def accept_everything() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            got.extend(conn.recv(4096))
            conn.sendall(b"\x01" + bytes(32))  # "accepted", with no proof
            while chunk := conn.recv(65536):
                got.extend(chunk)

    thread = threading.Thread(target=accept_everything)
    thread.start()
    sender = agent("prefill", TOKEN)
    try:
        target = SendTarget("x-1", f"127.0.0.1:{listener.getsockname()[1]}", 1, "decode")
        sent = Outcome()
        sender.send("p1", target, TransferBlocks.in_cache(cache(1), IDS), 10.0, sent)
        assert isinstance(sent.wait(), TransferRejectedError)
        assert "did not prove the pool's worker token" in str(sent.value)
        thread.join(10)
        assert len(got) == HEADER_BYTES + len(b"x-1")  # the header, no payload
    finally:
        listener.close()
        sender.close()


def test_a_worker_without_a_token_says_its_kv_port_is_open(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVFLOW_WORKER_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING):
        transport = make_transport(
            KvTransport.TCP, host="127.0.0.1", port=0, advertise_host="127.0.0.1",
            instance_id="w",
        )  # fmt: skip
    transport.close()
    assert "KVFLOW_WORKER_TOKEN" in caplog.text and "unauthenticated" in caplog.text
