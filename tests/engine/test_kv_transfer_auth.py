"""The KV port with the pool's worker token: only a sender that holds it writes KV.

Real TCP transports on loopback. Without the token a sender's transfer is refused before
any payload moves and the receiver's reserved blocks keep their bytes; the receiver still
waits for (and then takes) the transfer from the sender that holds the token.
"""

from __future__ import annotations

import torch
from testkit.kv_pair import Outcome, cache

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent
from kvflow.engine_worker.kv_transfer.base import SendTarget, TransferRejectedError
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport

IDS = [3, 1, 4, 9]


def agent(name: str, token: str | None) -> KvTransferAgent:
    transport = TcpTransport("127.0.0.1", 0, "127.0.0.1", token=token)
    return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)


def test_only_a_sender_with_the_token_writes_into_reserved_blocks() -> None:
    receiver = agent("decode", "s3cret")
    outsiders = [agent("no-token", None), agent("wrong-token", "guess")]
    insider = agent("prefill", "s3cret")
    try:
        src, dst = cache(1), cache(2)
        before = [kv[IDS].clone() for kv in dst]
        received = Outcome()
        ticket = receiver.receive("d1", TransferBlocks.in_cache(dst, IDS), 10.0, received)
        target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode")
        for outsider in outsiders:
            refused = Outcome()
            outsider.send("p", target, TransferBlocks.in_cache(src, IDS), 5.0, refused)
            assert isinstance(refused.wait(), TransferRejectedError)
            assert "tokens differ" in str(refused.value)
        assert not received.event.is_set()  # still waiting for the real sender
        for got, want in zip(dst, before, strict=True):
            assert torch.equal(got[IDS], want)
        sent = Outcome()
        insider.send("p", target, TransferBlocks.in_cache(src, IDS), 10.0, sent)
        assert received.wait() is None and not isinstance(sent.wait(), Exception)
        for got, want in zip(dst, src, strict=True):
            assert torch.equal(got[IDS], want[IDS])
    finally:
        for a in (receiver, insider, *outsiders):
            a.close()
