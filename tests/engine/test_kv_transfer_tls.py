"""The TCP KV port over mutual TLS (kv_transfer/tcp_tls.py), from certificates the real
openssl makes here, between real TCP transports on loopback.

Over TLS a transfer delivers the same blocks, in place and staged, and the wire carries no
readable KV. A sender that speaks plaintext, or presents a certificate another CA signed,
is refused at the handshake: the receiver's reserved blocks keep their bytes and it still
takes the transfer from a sender of the pool. A sender does not send to a receiver whose
certificate another CA signed, or does not carry the pool's name.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from testkit.certs import SERVICE_NAME, make_certs
from testkit.kv_pair import Outcome, cache

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent
from kvflow.engine_worker.kv_transfer.base import KvTransferError, SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

IDS = [3, 1, 4, 9]
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def pool_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pool-ca")
    make_certs(d)
    return d


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA, whose server certificate names the same hosts."""
    d = tmp_path_factory.mktemp("other-ca")
    make_certs(d)
    return d


def tls(d: Path, *, ca: Path | None = None, server_name: str | None = SERVICE_NAME) -> KvTls:
    """A worker's TLS from its certificate in ``d`` (a pool's workers share one, as the
    operator mounts it), trusting ``ca`` (default: ``d``'s CA)."""
    ca_file = (ca or d) / "ca.pem"
    return KvTls.from_files(str(d / "server.pem"), str(d / "server.key"), str(ca_file), server_name)


def agent(name: str, kv_tls: KvTls | None, *, in_place: bool = True) -> KvTransferAgent:
    transport = TcpTransport(
        "127.0.0.1", 0, "127.0.0.1", token=TOKEN, is_in_place=in_place, tls=kv_tls
    )
    transport.message_bytes = 1024  # staged: several messages per transfer
    return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)


@contextlib.contextmanager
def agents(*made: KvTransferAgent) -> Iterator[tuple[KvTransferAgent, ...]]:
    try:
        yield made
    finally:
        for a in made:
            a.close()


class RecordingRelay:
    """Relays connections to ``upstream`` and keeps every byte the sender wrote."""

    def __init__(self, upstream: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self._upstream = upstream
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self.listener.accept()
                host, port = self._upstream.rsplit(":", 1)
                up = socket.create_connection((host, int(port)))
                threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()
                threading.Thread(target=self._pipe, args=(down, up, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                if record:
                    self.sent += chunk
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def transfer(
    receiver: KvTransferAgent,
    sender: KvTransferAgent,
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    *,
    via: str | None = None,
) -> tuple[object, Outcome]:
    """One transfer of IDS from ``src`` to ``dst``: the sender's outcome, and the
    receiver's callback (still waiting when the transfer was refused)."""
    received = Outcome()
    ticket = receiver.receive("d", TransferBlocks.in_cache(dst, IDS), 10.0, received)
    target = SendTarget(ticket.transfer_id, via or ticket.endpoint, ticket.tag, "decode")
    sent = Outcome()
    sender.send("p", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
    return sent.wait(), received


def assert_landed(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    for got, want in zip(dst, src, strict=True):
        assert torch.equal(got[IDS], want[IDS])


def assert_untouched(dst: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    for got, want in zip(dst, before, strict=True):
        assert torch.equal(got[IDS], want)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_transfer_over_tls_delivers_the_same_blocks_and_no_readable_kv(
    pool_certs: Path, in_place: bool
) -> None:
    kv_tls = tls(pool_certs)
    with agents(
        agent("decode", kv_tls, in_place=in_place), agent("prefill", kv_tls, in_place=in_place)
    ) as (
        receiver,
        sender,
    ):
        relay = RecordingRelay(receiver.endpoint)
        try:
            for seed in (1, 3):  # the second over the kept connection
                src, dst = cache(seed), cache(seed + 1)
                sent, received = transfer(receiver, sender, src, dst, via=relay.endpoint)
                assert not isinstance(sent, Exception), sent
                assert received.wait() is None
                assert_landed(src, dst)
            # Not one 64-byte piece of a sent block crosses the wire as it is in the cache.
            wire = bytes(relay.sent)
            assert len(wire) > src[0][IDS].numel() * 4 * 2
            for kv in src:
                raw = kv[IDS].numpy().tobytes()
                for start in range(0, len(raw), 4096):
                    assert raw[start : start + 64] not in wire
        finally:
            relay.close()


def test_a_plaintext_sender_is_refused_and_the_receiver_waits_for_the_pool(
    pool_certs: Path,
) -> None:
    kv_tls = tls(pool_certs)
    with agents(agent("decode", kv_tls), agent("plain", None), agent("prefill", kv_tls)) as (
        receiver,
        plain,
        insider,
    ):
        src, dst = cache(1), cache(2)
        before = [kv[IDS].clone() for kv in dst]
        received = Outcome()
        ticket = receiver.receive("d", TransferBlocks.in_cache(dst, IDS), 10.0, received)
        target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode")
        refused = Outcome()
        plain.send("p", target, TransferBlocks.in_cache(src, IDS), 5.0, refused)
        assert isinstance(refused.wait(), KvTransferError)
        assert plain.num_active == 0
        assert not received.event.is_set()  # nothing landed; still waiting
        assert_untouched(dst, before)
        sent = Outcome()
        insider.send("p", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
        assert received.wait() is None and not isinstance(sent.wait(), Exception)
        assert_landed(src, dst)


def test_a_tls_sender_does_not_send_to_a_plaintext_receiver(pool_certs: Path) -> None:
    with agents(agent("decode", None), agent("prefill", tls(pool_certs))) as (receiver, sender):
        src, dst = cache(1), cache(2)
        before = [kv[IDS].clone() for kv in dst]
        sent, received = transfer(receiver, sender, src, dst)
        assert isinstance(sent, KvTransferError) and "runs no KV TLS" in str(sent)
        assert not received.event.is_set()
        assert_untouched(dst, before)


def test_a_sender_with_a_certificate_from_another_ca_is_refused(
    pool_certs: Path, other_certs: Path
) -> None:
    # The outsider trusts the pool's CA (it would accept the receiver) but presents a
    # certificate of its own CA: the receiver refuses it at the handshake.
    outsider_tls = tls(other_certs, ca=pool_certs)
    with agents(agent("decode", tls(pool_certs)), agent("outsider", outsider_tls)) as (
        receiver,
        outsider,
    ):
        src, dst = cache(1), cache(2)
        before = [kv[IDS].clone() for kv in dst]
        sent, received = transfer(receiver, outsider, src, dst)
        assert isinstance(sent, KvTransferError)
        assert not received.event.is_set()
        assert_untouched(dst, before)


@pytest.mark.parametrize("server_name", [SERVICE_NAME, "other-pool-workers.ns.svc"])
def test_a_sender_refuses_a_receiver_it_cannot_verify(
    pool_certs: Path, other_certs: Path, server_name: str
) -> None:
    """A receiver with another CA's certificate (for the same names), or a name the
    pool's certificate does not carry: no KV goes there."""
    receiver_certs = other_certs if server_name == SERVICE_NAME else pool_certs
    receiver_tls = tls(receiver_certs, ca=pool_certs)
    sender_tls = tls(pool_certs, server_name=server_name)
    with agents(agent("decode", receiver_tls), agent("prefill", sender_tls)) as (
        receiver,
        sender,
    ):
        src, dst = cache(1), cache(2)
        before = [kv[IDS].clone() for kv in dst]
        sent, received = transfer(receiver, sender, src, dst)
        assert isinstance(sent, KvTransferError)
        assert "certificate" in str(sent) and "no KV goes to" in str(sent)
        assert not received.event.is_set()
        assert_untouched(dst, before)


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_transfer_larger_than_the_socket_buffers_lands_whole(
    pool_certs: Path, in_place: bool
) -> None:
    """48 MiB of scattered blocks: TLS writes that would block resume with the same bytes,
    reads resume where they stopped."""
    shape = kv_cache_shape(num_blocks=64, block_size=16, num_kv_heads=8, head_dim=128)
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(shape, generator=gen) for _ in range(2)]
    dst = [torch.zeros(shape) for _ in range(2)]
    ids = [*range(0, 40, 2), *range(41, 64)]  # runs of one block and one long run
    kv_tls = tls(pool_certs)
    with agents(agent("decode", kv_tls, in_place=in_place), agent("prefill", kv_tls)) as (
        receiver,
        sender,
    ):
        sender.transport.message_bytes = 4 << 20  # type: ignore[attr-defined]
        received = Outcome()
        ticket = receiver.receive("d", TransferBlocks.in_cache(dst, ids), 20.0, received)
        target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode")
        sent = Outcome()
        sender.send("p", target, TransferBlocks.in_cache(src, ids), 20.0, sent)
        assert received.wait() is None and not isinstance(sent.wait(), Exception)
        for got, want in zip(dst, src, strict=True):
            assert torch.equal(got[ids], want[ids])
