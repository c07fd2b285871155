"""``--kv-peer-allow``: a worker opens KV connections only to endpoints inside the listed
networks, checked at the address it then connects to; outside them it refuses by name,
before any connection. Real TCP and gloo transports on loopback."""

from __future__ import annotations

import socket

import pytest
import torch
from testkit.kv_pair import Outcome, cache

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.peers import KvPeerRefusedError, PeerAllowList, resolve_peer
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport
from kvflow.engine_worker.settings import parse_args
from kvflow.proto.transports import KvTransport

IDS = [3, 1, 4, 9]
TOKEN = "s3cret"


def test_the_list_parses_networks_and_addresses_and_names_a_bad_entry() -> None:
    allow = PeerAllowList.parse("10.244.0.0/16, 192.168.1.7 fd00::/8")
    assert allow is not None
    assert allow.allows("10.244.3.4") and allow.allows("192.168.1.7") and allow.allows("fd00::1")
    assert not allow.allows("10.245.0.1") and not allow.allows("127.0.0.1")
    assert PeerAllowList.parse("") is None and PeerAllowList.parse(None) is None
    with pytest.raises(ValueError, match=r"'pods\.local' is not a network"):
        PeerAllowList.parse("10.0.0.0/8,pods.local")


def test_a_name_is_checked_at_the_address_it_resolves_to() -> None:
    loopback = PeerAllowList.parse("127.0.0.0/8")
    assert resolve_peer("localhost:5000", loopback) == ("127.0.0.1", 5000)
    with pytest.raises(KvPeerRefusedError, match=r"localhost:5000 \(127.0.0.1\) is outside"):
        resolve_peer("localhost:5000", PeerAllowList.parse("10.0.0.0/8"))
    assert resolve_peer("anything:1", None) == ("anything", 1)  # unset: as given


def test_tcp_refuses_an_endpoint_outside_the_list_before_connecting() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    sender = KvTransferAgent(
        TcpTransport("127.0.0.1", 0, "127.0.0.1", token=TOKEN,
                     peer_allow=PeerAllowList.parse("10.0.0.0/8")),
        instance_id="prefill", max_timeout_s=10,
    )  # fmt: skip
    try:
        target = SendTarget("x-1", f"127.0.0.1:{listener.getsockname()[1]}", 1, "decode")
        sent = Outcome()
        sender.send("p1", target, TransferBlocks.in_cache(cache(1), IDS), 5.0, sent)
        assert isinstance(sent.wait(), KvPeerRefusedError)
        assert "outside --kv-peer-allow (10.0.0.0/8)" in str(sent.value)
        with pytest.raises(TimeoutError):
            listener.accept()  # no connection was ever opened
    finally:
        listener.close()
        sender.close()


def test_tcp_sends_to_an_endpoint_inside_the_list() -> None:
    allow = PeerAllowList.parse("127.0.0.0/8")
    receiver = KvTransferAgent(TcpTransport("127.0.0.1", 0, "127.0.0.1", token=TOKEN),
                               instance_id="decode", max_timeout_s=10)  # fmt: skip
    sender = KvTransferAgent(TcpTransport("127.0.0.1", 0, "127.0.0.1", token=TOKEN,
                                          peer_allow=allow),
                             instance_id="prefill", max_timeout_s=10)  # fmt: skip
    try:
        src, dst = cache(1), cache(2)
        received = Outcome()
        ticket = receiver.receive("d1", TransferBlocks.in_cache(dst, IDS), 10.0, received)
        endpoint = ticket.endpoint.replace("127.0.0.1", "localhost")  # a name, resolved
        target = SendTarget(ticket.transfer_id, endpoint, ticket.tag, "decode")
        sent = Outcome()
        sender.send("p1", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
        assert received.wait() is None and not isinstance(sent.wait(), Exception)
        for got, want in zip(dst, src, strict=True):
            assert torch.equal(got[IDS], want[IDS])
    finally:
        receiver.close()
        sender.close()


def test_gloo_refuses_a_store_outside_the_list_before_connecting() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    allow = PeerAllowList.parse("10.0.0.0/8")
    sender = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", "prefill",
                                token=TOKEN, peer_allow=allow)  # fmt: skip
    try:
        target = SendTarget("x-1", f"127.0.0.1:{listener.getsockname()[1]}", 1, "decode")
        with pytest.raises(KvPeerRefusedError, match="outside --kv-peer-allow"):
            sender.send(target, TransferBlocks.in_cache(cache(1), IDS), 5.0)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_the_worker_flag() -> None:
    assert parse_args(["--kv-peer-allow", "10.244.0.0/16"]).kv_peer_allow == "10.244.0.0/16"
    assert parse_args([]).kv_peer_allow == ""
    with pytest.raises(SystemExit):
        parse_args(["--kv-peer-allow", "decode-*.pool"])
