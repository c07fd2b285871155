"""The gloo transport with the pool's worker token: no group forms with, and no KV goes
to or comes from, a peer that has not proved the token (kv_transfer/group_auth.py).

Real torch.distributed gloo groups between two processes on loopback: the receiver (a
decode worker's transport) here, each sender in a child process of its own. An outsider
that knows the transfer's id and reaches the store, without the token or with a wrong one,
is refused at its rendezvous key, before any group forms: the reserved blocks keep their
bytes, no group is kept, and the next transfer, from a sender with the token, lands. Inside
a group, the challenge-response refuses a peer whose token differs (an outsider who got a
rank by writing the group's own keys).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from testkit.kv_pair import cache

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.base import TransferRejectedError
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.group_auth import ROLES, group_mac
from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport
from kvflow.proto.transports import KvTransport

pytestmark = pytest.mark.integration

IDS = [3, 1, 4, 9]
TOKEN = "s3cret"

# A sender in a process of its own, the cache of cache(1) below: it says READY once torch
# is loaded, then sends to the ticket it reads from stdin.
SENDER = """
import json, sys, torch
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.proto.transports import KvTransport

name, token = sys.argv[1], (sys.argv[2] or None)
gen = torch.Generator().manual_seed(1)
shape = kv_cache_shape(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
cache = [torch.randn(shape, generator=gen) for _ in range(2)]
transport = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", name,
                               token=token)
print("READY", flush=True)
a = json.loads(sys.stdin.readline())
target = SendTarget(a["transfer_id"], a["endpoint"], a["tag"], "decode")
try:
    transport.send(target, TransferBlocks.in_cache(cache, a["ids"]), a["timeout_s"])
    print("SENT", flush=True)
except Exception as exc:
    print(f"REFUSED {type(exc).__name__}: {exc}", flush=True)
"""


class Sender:
    """A sender process, started and loaded before a transfer's clock starts."""

    def __init__(self, name: str, token: str | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SENDER, name, token or ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "READY", line + self.proc.stderr.read()  # type: ignore[union-attr]

    def send(self, ticket: Any, timeout_s: float) -> None:
        args = {"transfer_id": ticket.transfer_id, "endpoint": ticket.endpoint,
                "tag": ticket.tag, "ids": IDS, "timeout_s": timeout_s}  # fmt: skip
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()

    def result(self) -> str:
        out, err = self.proc.communicate(timeout=60)
        return out.strip() + err


class Outcome:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def __call__(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def wait(self) -> Any:
        assert self.event.wait(30), "no completion"
        return self.value


def test_only_a_peer_that_proves_the_token_sends_kv_over_gloo() -> None:
    transport = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", "decode",
                                   token=TOKEN)  # fmt: skip
    receiver = KvTransferAgent(transport, instance_id="decode", max_timeout_s=30.0)
    try:
        dst = cache(2)
        before = [kv[IDS].clone() for kv in dst]
        for name, token in (("wrong-token", "guess"), ("no-token", None)):
            outsider = Sender(name, token)
            received = Outcome()
            started_s = time.monotonic()
            ticket = receiver.receive(name, TransferBlocks.in_cache(dst, IDS), 4.0, received)
            outsider.send(ticket, timeout_s=4.0)
            error = received.wait()
            assert isinstance(error, TransferRejectedError), error
            assert "rendezvous key does not prove the pool's worker token" in str(error)
            assert time.monotonic() - started_s < 3.0  # at once, not at the deadline
            # The outsider heard no answer to its nonce (with a token: it formed no group)
            # or formed a group nobody joined.
            assert outsider.result().startswith("REFUSED")
            for got, want in zip((kv[IDS] for kv in dst), before, strict=True):
                assert torch.equal(got, want)  # not a byte of the outsider's KV landed
        groups = transport.groups
        assert groups.formed == {} and groups.broken == []  # no group ever formed

        insider = Sender("prefill", TOKEN)
        received = Outcome()
        ticket = receiver.receive("insider", TransferBlocks.in_cache(dst, IDS), 20.0, received)
        insider.send(ticket, timeout_s=20.0)
        assert received.wait() is None
        assert insider.result().startswith("SENT")
        for got, want in zip((kv[IDS] for kv in dst), (kv[IDS] for kv in cache(1)), strict=True):
            assert torch.equal(got, want)
        assert len(transport.groups.formed) == 1  # the proven group is cached for the next transfer
    finally:
        receiver.close()


def test_each_role_proves_something_different_bound_to_the_group_and_nonces() -> None:
    n0, n1 = b"\1" * 32, b"\2" * 32
    sender = group_mac(TOKEN, ROLES[0], "g-1", n0, n1)
    assert sender != group_mac(TOKEN, ROLES[1], "g-1", n0, n1)  # no reflecting the peer's
    assert sender != group_mac(TOKEN, ROLES[0], "g-2", n0, n1)
    assert sender != group_mac(TOKEN, ROLES[0], "g-1", n1, n0)
    assert sender != group_mac("guess", ROLES[0], "g-1", n0, n1)


def test_workers_give_the_gloo_transport_the_pool_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_WORKER_TOKEN", TOKEN)
    transport = make_transport(KvTransport.GLOO, host="127.0.0.1", port=0,
                               advertise_host="127.0.0.1", instance_id="w")  # fmt: skip
    assert isinstance(transport, TorchDistTransport) and transport._token == TOKEN
    monkeypatch.delenv("KVFLOW_WORKER_TOKEN")
    transport = make_transport(KvTransport.GLOO, host="127.0.0.1", port=0,
                               advertise_host="127.0.0.1", instance_id="w")  # fmt: skip
    assert isinstance(transport, TorchDistTransport) and transport._token is None
