"""gloo KV groups with the pool's worker token: a sender forms no group with a store whose
owner cannot prove the token, the in-group handshake refuses a peer whose token differs,
and a failed transfer's group is destroyed once nothing can be pending in it.

Real torch.distributed gloo groups and TCPStores on loopback; the sender of the failing
transfer is a child process of its own (a worker's transport, paused by the same fault
injection the PD fault tests use)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent
from kvflow.engine_worker.kv_transfer.base import (
    SendTarget,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.group_auth import HandshakeRefusedError, prove_peer
from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport
from kvflow.engine_worker.kv_transfer.torch_dist_groups import make_group
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.proto.transports import KvTransport

pytestmark = pytest.mark.integration

IDS = [3, 1, 4, 9]
TOKEN = "s3cret"

SENDER = """
import json, sys, torch
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.torch_dist import TorchDistTransport
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.proto.transports import KvTransport

shape = kv_cache_shape(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
cache = [torch.zeros(shape) for _ in range(2)]
transport = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", "prefill",
                               token=sys.argv[1])
print("READY", flush=True)
a = json.loads(sys.stdin.readline())
target = SendTarget(a["transfer_id"], a["endpoint"], a["tag"], "decode")
try:
    transport.send(target, TransferBlocks.in_cache(cache, a["ids"]), a["timeout_s"])
    print("SENT", flush=True)
except Exception as exc:
    print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
"""


def cache() -> list[torch.Tensor]:
    shape = kv_cache_shape(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
    return [torch.zeros(shape) for _ in range(2)]


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        # The listing's own descriptor is closed by the time it is read.
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_a_sender_forms_no_group_with_a_store_that_cannot_prove_the_token() -> None:
    """A reservation naming some TCPStore outside the pool: nobody answers the nonce."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sender = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", "prefill",
                                token=TOKEN)  # fmt: skip
    target = SendTarget("x-1", f"127.0.0.1:{store.port}", 1, "decode")
    started_s = time.monotonic()
    with pytest.raises(TransferRejectedError, match="did not prove the pool's worker token"):
        sender.send(target, TransferBlocks.in_cache(cache(), IDS), 2.0)
    assert time.monotonic() - started_s < 5.0
    assert sender.groups.formed == {} and sender.groups.broken == []
    # Its key names a group and carries a MAC, not the KV: nothing else was written there.
    assert store.num_keys() <= 2


def test_the_in_group_handshake_refuses_a_peer_with_another_token() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors: list[BaseException | None] = [None, None]
    groups: list[Any] = []  # alive until both ranks are done: closing one fails the other

    def rank(r: int, token: str) -> None:
        # A store client of its own: one runs one call at a time, and forming waits in one.
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        try:
            group = make_group(KvTransport.GLOO, client, "g-1", r, 10.0)
            groups.append(group)
            prove_peer(group, "g-1", r, token, time.monotonic() + 10, torch.device("cpu"))
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r, t)) for r, t in ((0, TOKEN), (1, "x"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, HandshakeRefusedError) and e.is_idle for e in errors), errors


class Outcome:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def __call__(self, value: Any) -> None:
        self.value = value
        self.event.set()


def test_a_failed_transfers_group_is_destroyed_after_its_timeout() -> None:
    """The sender (with the token) joins the pair's group and then stalls; the receive runs
    out its deadline. The group is parked, then destroyed: its sockets are closed."""
    transport = TorchDistTransport(KvTransport.GLOO, "127.0.0.1", 0, "127.0.0.1", "decode",
                                   token=TOKEN)  # fmt: skip
    receiver = KvTransferAgent(transport, instance_id="decode", max_timeout_s=30.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER, TOKEN],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KVFLOW_FAULT_KV_SEND_PAUSE_S": "60"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "READY"
        received = Outcome()
        ticket = receiver.receive("d1", TransferBlocks.in_cache(cache(), IDS), 3.0, received)
        args = {"transfer_id": ticket.transfer_id, "endpoint": ticket.endpoint,
                "tag": ticket.tag, "ids": IDS, "timeout_s": 20.0}  # fmt: skip
        proc.stdin.write(json.dumps(args) + "\n")
        proc.stdin.flush()
        assert received.event.wait(20)
        assert isinstance(received.value, TransferTimeoutError), received.value
        received.value = None  # its traceback holds the group's frames
        deadline = time.monotonic() + 5
        while not transport.groups.broken and time.monotonic() < deadline:
            time.sleep(0.05)  # the transfer thread parks the group as it ends
        assert len(transport.groups.broken) == 1 and transport.groups.formed == {}
        gc.collect()
        parked = open_sockets()
        deadline = time.monotonic() + 15
        while transport.groups.broken and time.monotonic() < deadline:
            time.sleep(0.1)
        assert transport.groups.broken == [] and transport.groups.timeouts_s == {}
        gc.collect()
        assert open_sockets() < parked  # the group's connections are closed
    finally:
        proc.kill()
        proc.wait(10)
        receiver.close()
