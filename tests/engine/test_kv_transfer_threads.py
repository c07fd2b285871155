"""The agent's transfer threads: a receive never waits for a thread (however many are
pending, a landed payload is heard of at once), a send stuck in its handshake ends as soon
as it is cancelled, and the threads do not grow with the number of transfers.

Real TCP transports on 127.0.0.1, real threads; the silent receivers are bare listening
sockets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from testkit.kv_pair import Outcome, cache

from kvflow.engine_worker.kv_transfer import agent
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, SendStats
from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    SendTarget,
    TransferCancelledError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport

IDS = [3, 7, 1, 10]


def tcp_agent(name: str) -> KvTransferAgent:
    transport = TcpTransport("127.0.0.1", 0, "127.0.0.1")
    return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)


class Calls:
    """A callback that keeps every call (each on_done must come exactly once)."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.event = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, value: Any) -> None:
        with self._lock:
            self.values.append(value)
        self.event.set()


@pytest.fixture
def agents() -> Iterator[tuple[KvTransferAgent, KvTransferAgent]]:
    sender, receiver = tcp_agent("prefill-t"), tcp_agent("decode-t")
    yield sender, receiver
    sender.close()
    receiver.close()


def test_a_landed_payload_is_heard_of_while_many_more_receives_wait(
    agents: tuple[KvTransferAgent, KvTransferAgent],
) -> None:
    """20 receives pending, more than the 16 transfer threads the agent once shared: only
    the 20th's sender comes, and its receive completes at once while the other 19 wait."""
    sender, receiver = agents
    dst = [cache(seed) for seed in range(20)]
    calls = [Calls() for _ in range(20)]
    tickets = [
        receiver.receive(f"d{i}", TransferBlocks.in_cache(dst[i], IDS), 20.0, calls[i])
        for i in range(20)
    ]
    src = cache(99)
    last = tickets[-1]
    sent = Outcome()
    started = time.monotonic()
    target = SendTarget(last.transfer_id, last.endpoint, last.tag, "decode-t")
    sender.send("p19", target, TransferBlocks.in_cache(src, IDS), 20.0, sent)
    assert calls[19].event.wait(2.0), "the 20th receive's landed KV went unnoticed"
    assert time.monotonic() - started < 2.0
    assert calls[19].values == [None]
    assert isinstance(sent.wait(), SendStats)
    for got, want in zip(dst[19], src, strict=True):
        assert torch.equal(got[IDS], want[IDS])
    assert all(not c.values for c in calls[:19])  # still waiting for their senders
    assert receiver.num_active == 19
    for i in range(19):
        assert receiver.cancel(f"d{i}")
    deadline = time.monotonic() + 2.0
    while receiver.num_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.num_active == 0  # their threads ended too
    for c in calls[:19]:
        assert len(c.values) == 1 and isinstance(c.values[0], TransferCancelledError)


def _cancelled_quickly(target: SendTarget) -> None:
    """Send with a 30 s timeout, cancel after 0.2 s: the send ends with
    TransferCancelledError well before its deadline."""
    sender = tcp_agent("prefill-s")
    try:
        sent = Calls()
        blocks = TransferBlocks.in_cache(cache(5), IDS)
        sender.send("p1", target, blocks, 30.0, sent)
        time.sleep(0.2)
        started = time.monotonic()
        assert sender.cancel("p1")
        assert blocks.is_revoked
        assert sent.event.wait(1.5), "the cancelled send still waits on its receiver"
        assert time.monotonic() - started < 1.5
        assert len(sent.values) == 1 and isinstance(sent.values[0], TransferCancelledError)
        assert sender.num_active == 0
    finally:
        sender.close()


def test_a_send_whose_receiver_never_answers_the_header_ends_on_cancel() -> None:
    """The kernel completes the connection on the listener's backlog; nobody ever reads
    the header or answers it."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        _cancelled_quickly(SendTarget("x-1", endpoint, 1, "decode-s"))


def test_a_send_whose_connect_hangs_ends_on_cancel() -> None:
    """A listener whose accept queue is full drops new SYNs: the connect hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        with socket.create_connection(address, timeout=2):  # fills the queue
            _cancelled_quickly(SendTarget("x-2", f"127.0.0.1:{address[1]}", 1, "decode-s"))


def test_transfer_threads_stay_bounded_and_end_with_the_agents() -> None:
    """200 round trips and 60 cancels (receives nobody sends to, sends to a receiver that
    never answers), 20 receives at a time: the threads stay within the pools' sizes, and
    closing the agents ends them all."""
    baseline = threading.active_count()
    before = _threads()
    max_receives = 32
    sender = tcp_agent("prefill-l")
    transport = TcpTransport("127.0.0.1", 0, "127.0.0.1")
    receiver = KvTransferAgent(
        transport, instance_id="decode-l", max_timeout_s=30.0, max_receives=max_receives
    )
    silent = socket.create_server(("127.0.0.1", 0))
    silent_endpoint = f"127.0.0.1:{silent.getsockname()[1]}"

    def blocks(seed: int) -> TransferBlocks:
        return TransferBlocks.in_cache(cache(seed), IDS)

    try:
        for batch in range(10):
            received, sent, ignored, unanswered = Calls(), Calls(), Calls(), Calls()
            for i in range(20):
                ticket = receiver.receive(f"d{batch}-{i}", blocks(i), 10.0, received)
                target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode-l")
                sender.send(f"p{batch}-{i}", target, blocks(i), 10.0, sent)
            for i in range(3):
                receiver.receive(f"c{batch}-{i}", blocks(i), 10.0, ignored)
                target = SendTarget(f"x-{batch}-{i}", silent_endpoint, 1, "decode-s")
                sender.send(f"s{batch}-{i}", target, blocks(i), 10.0, unanswered)
            for i in range(3):
                assert receiver.cancel(f"c{batch}-{i}")
                assert sender.cancel(f"s{batch}-{i}")
            deadline = time.monotonic() + 5.0
            while (receiver.num_active or sender.num_active) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert receiver.num_active == sender.num_active == 0
            assert received.values == [None] * 20
            assert all(isinstance(v, SendStats) for v in sent.values) and len(sent.values) == 20
            for calls in (ignored, unanswered):
                assert len(calls.values) == 3
                assert all(isinstance(v, TransferCancelledError) for v in calls.values)
        # Idle pool threads (as many as the pools' sizes at most), two acceptors, and a
        # receiver thread per connection the sender keeps (4 at most; those it did not keep
        # end as the sender closes them).
        bound = max_receives + agent.MAX_CONCURRENT_SENDS + 2 + 4
        deadline = time.monotonic() + 2.0
        while threading.active_count() - baseline > bound and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() - baseline <= bound
    finally:
        sender.close()
        receiver.close()
        silent.close()
    deadline = time.monotonic() + 5.0
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    # At most: a thread an earlier test left may end meanwhile.
    assert _threads() <= before, [t.name for t in threading.enumerate()]


def _threads() -> int:
    """Live threads, the TCP transports' acceptors included (a closed transport ends its)."""
    return threading.active_count()


def test_a_send_error_is_not_a_cancel(agents: tuple[KvTransferAgent, KvTransferAgent]) -> None:
    """The polled handshake keeps its other endings: a receiver that does not expect the
    transfer refuses it (not a cancel, not a timeout)."""
    sender, receiver = agents
    sent = Outcome()
    target = SendTarget("nobody-expects-this", receiver.endpoint, 1, "decode-t")
    sender.send("p1", target, TransferBlocks.in_cache(cache(2), IDS), 5.0, sent)
    error = sent.wait()
    assert isinstance(error, KvTransferError) and error.kind == "rejected"


def test_gloo_receives_move_at_most_the_staging_bound_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Receives wait for their senders without limit, but at most MAX_MOVING_RECEIVES move
    a payload (hold staging buffers) at once: 4 senders at once, a bound of 2; every
    transfer still lands, and the peak of payloads moving is 2 (real gloo groups)."""
    from kvflow.engine_worker.kv_transfer import torch_dist
    from kvflow.engine_worker.kv_transfer.agent import make_transport
    from kvflow.proto.transports import KvTransport

    monkeypatch.setattr(torch_dist, "MAX_MOVING_RECEIVES", 2)
    moving, peak, lock = [0], [0], threading.Lock()
    real = torch_dist.receive_messages

    def counted(*args: Any, **kwargs: Any) -> None:
        with lock:
            moving[0] += 1
            peak[0] = max(peak[0], moving[0])
        try:
            time.sleep(0.2)  # long enough for the other senders to arrive meanwhile
            real(*args, **kwargs)
        finally:
            with lock:
                moving[0] -= 1

    monkeypatch.setattr(torch_dist, "receive_messages", counted)

    def gloo(name: str) -> KvTransferAgent:
        transport = make_transport(KvTransport.GLOO, host="127.0.0.1", port=0,
                                   advertise_host="127.0.0.1", instance_id=name)  # fmt: skip
        return KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0)

    receiver = gloo("decode-g")
    senders = [gloo(f"prefill-g{i}") for i in range(4)]
    try:
        src = [cache(10 + i) for i in range(4)]
        dst = [cache(20 + i) for i in range(4)]
        received = [Calls() for _ in range(4)]
        sent = [Calls() for _ in range(4)]
        for i, sender in enumerate(senders):
            ticket = receiver.receive(f"d{i}", TransferBlocks.in_cache(dst[i], IDS), 20.0,
                                      received[i])  # fmt: skip
            target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode-g")
            sender.send(f"p{i}", target, TransferBlocks.in_cache(src[i], IDS), 20.0, sent[i])
        for i in range(4):
            assert received[i].event.wait(20) and sent[i].event.wait(20), i
            assert received[i].values == [None], received[i].values
            assert isinstance(sent[i].values[0], SendStats), sent[i].values
            for got, want in zip(dst[i], src[i], strict=True):
                assert torch.equal(got[IDS], want[IDS])
        assert peak[0] == 2
    finally:
        for a in [receiver, *senders]:
            a.close()
