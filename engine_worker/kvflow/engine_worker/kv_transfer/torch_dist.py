"""KV blocks over torch.distributed point-to-point: gloo for CPU tensors, NCCL for CUDA.

Workers come and go, so there is no global world: every pair of workers that transfers
gets its own two-rank process group, formed on demand. The decode worker hosts a TCPStore
(its KV port) as the rendezvous. To send, a prefill worker connects to that store, writes
``kvflow/xfer/<transfer id> = <group name>`` and joins the group as rank 0; the decode
worker reads the name and joins as rank 1 (a PrefixStore keeps each group's keys apart).
Groups are cached per pair, so only a pair's first transfer pays the rendezvous; later ones
cost one store write and read. Concurrent transfers of a pair share the group under
distinct tags (the decode worker numbers them).

A transfer moves as pipelined messages of up to 16 MiB (pipeline.py).

A group whose transfer failed or timed out may still hold a half-done send or receive, so
it is never reused: the side that notices marks it ``kvflow/broken/<name>`` in the store
and the next transfer forms a fresh group with a new name. The failed group is parked
until every operation in it has run out its timeout, then destroyed (its connections and
ports closed); nothing of it outlives that (torch_dist_groups.py).

With the pool's worker token (KVFLOW_WORKER_TOKEN) the store is open to anyone who reaches
the port, so both sides prove the token before a group forms, in signed rendezvous keys
(group_auth.py): the receiver joins only a group a token holder named, the sender forms a
group only with a store whose owner answered its nonce. Each new group then runs a mutual
HMAC challenge-response over its own connections before it carries KV. A peer that fails
either is refused (the transfer fails, its blocks are freed) and no group is cached.

Every group has an explicit timeout (the transfer's deadline when it formed): gloo's is its
operations' timeout, NCCL's its watchdog's (the host polls NCCL work against the same
deadline, pipeline.wait_work). NCCL's watchdog would by default take the whole process down
when an operation times out or its peer vanishes; a worker with the NCCL transport sets
NCCL_WATCHDOG_ENV (nccl_watchdog.py) before its first group forms so that a dead peer
costs one transfer (which falls back to a local prefill), never the worker.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist

from kvflow.engine_worker.kv_transfer.base import (
    KvTransferError,
    PeerUnreachableError,
    SendTarget,
    TransferCancelledError,
    TransferRejectedError,
    TransferTimeoutError,
)
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.group_auth import (
    check_rendezvous,
    rendezvous_answer,
    signed_rendezvous,
)
from kvflow.engine_worker.kv_transfer.nccl_watchdog import apply_nccl_watchdog_env
from kvflow.engine_worker.kv_transfer.peers import PeerAllowList, resolve_peer
from kvflow.engine_worker.kv_transfer.pipeline import Staging, receive_messages, send_messages
from kvflow.engine_worker.kv_transfer.staging import MESSAGE_BYTES, StagingPool
from kvflow.engine_worker.kv_transfer.torch_dist_groups import PairGroups
from kvflow.proto.transports import KvTransport

log = logging.getLogger(__name__)
# torch.distributed's stubs do not export the store and group classes used here.
dist: Any = _dist

# A receiver blocks in a store wait() for its sender's key, which wakes it at once: a
# 16-byte transfer took 0.44 ms median (P90 0.61) this way, 1.16 ms (P90 2.52) when it
# polled the key every 2 ms. A TCPStore client runs one call at a time, so each waiting
# receive uses a client of its own (pooled; the shared one would hold up every other
# call for as long as one receive waits), and a cancel wakes it by writing the key itself.
_CANCELLED = b""
# Idle waiters kept for reuse. Up to max_num_seqs receives wait at once (the agent gives
# each a thread): one that finds no idle waiter opens a client (0.44 ms median on loopback
# here, P90 0.66), and of those a burst opened, 16 are kept afterwards.
_MAX_IDLE_WAITERS = 16
# Receives whose payload is moving at once. Waiting for a sender takes no staging; moving
# takes PIPELINE_DEPTH messages (32 MiB; with NCCL, of GPU memory the worker's budget does
# not count), so a decode worker that many prefill workers send to at once holds at most
# 16 x 32 MiB, as when one pool of 16 threads ran every transfer. A sender found past
# that waits for a seat (its group forms when the receiver joins), within its deadline.
MAX_MOVING_RECEIVES = 16
# How often a receive waiting for a seat looks at its cancel event.
_SEAT_POLL_S = 0.02
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
# Fault injection for tests only: pause this long between joining the pair's group and
# sending, so a test can kill a worker mid-transfer. Never set in production.
_FAULT_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_KV_SEND_PAUSE_S", "0"))


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of the frames a failed transfer's error carries: they hold its group
    (and its pending work), which would otherwise live, sockets, threads and NCCL buffers,
    for as long as anyone keeps the error, past the parked group's destroy."""
    traceback.clear_frames(exc.__traceback__)


@dataclass(eq=False)
class _Expected:
    tag: int
    blocks: TransferBlocks


class TorchDistTransport:
    def __init__(
        self, kind: KvTransport, host: str, port: int, advertise_host: str, instance_id: str,
        token: str | None = None, peer_allow: PeerAllowList | None = None,
    ) -> None:  # fmt: skip
        """``token``: the pool's worker token, proven by both sides before a group forms and
        by both ranks of every new group (group_auth.py); None: groups are trusted as formed
        (a laptop, a test). ``peer_allow``: the networks this worker sends to (None: any;
        peers.py)."""
        assert kind in (KvTransport.GLOO, KvTransport.NCCL)
        self._peer_allow = peer_allow
        self.kind: KvTransport = kind
        if kind is KvTransport.NCCL:
            apply_nccl_watchdog_env()
        self._instance_id = instance_id
        self._token = token
        # TCPStore binds every address when it opens its own socket; bind --host ourselves
        # so two workers on different addresses of one machine can share a port.
        listener = socket.create_server((host, port), backlog=128)
        bound_port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            host,
            bound_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )
        self.port = bound_port
        self.endpoint = f"{advertise_host}:{self.port}"
        self._store_host = _LOOPBACK.get(host, host)
        self._idle_waiters: list[Any] = []
        self._expected: dict[str, _Expected] = {}
        self._lock = threading.Lock()
        self.groups = PairGroups(kind, token)  # both sides'
        # Sender side: endpoint -> store client, and the group currently used per peer.
        self._clients: dict[str, Any] = {}
        self._send_group: dict[str, str] = {}
        self._names = itertools.count()
        self.pool = StagingPool()
        self.message_bytes = MESSAGE_BYTES  # both sides must agree; tests make it small
        self._moving = threading.BoundedSemaphore(MAX_MOVING_RECEIVES)

    def _pipe(self, blocks: TransferBlocks) -> Staging:
        # gloo moves CPU tensors; NCCL the cache's own device.
        device = blocks.device if self.kind is KvTransport.NCCL else torch.device("cpu")
        return Staging(self.pool, device, self.message_bytes)

    # -- groups ----------------------------------------------------------------------------

    def expect(self, transfer_id: str, tag: int, blocks: TransferBlocks) -> None:
        with self._lock:
            self._expected[transfer_id] = _Expected(tag, blocks)

    def receive(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        with self._lock:
            expected = self._expected[transfer_id]
        key = f"kvflow/xfer/{transfer_id}"
        name = None
        try:
            value = self._wait_for_key(key, deadline_s)
            if value is None:
                raise TransferTimeoutError(f"transfer {transfer_id}: no sender before the deadline")
            if cancel.is_set() or value == _CANCELLED:
                raise TransferCancelledError(f"transfer {transfer_id} cancelled")
            group_name, nonce = check_rendezvous(self._token, transfer_id, value)
            self._take_seat(transfer_id, deadline_s, cancel)
            try:
                if self._token is not None:  # the sender forms a new group only after this
                    answer = rendezvous_answer(self._token, transfer_id, group_name, nonce)
                    self._store.set(f"kvflow/ack/{transfer_id}", answer)
                name = group_name
                group = self.groups.group(
                    self._store, name, 1, deadline_s, self._pipe(expected.blocks).device
                )
                receive_messages(
                    group, expected.blocks, expected.tag, deadline_s,
                    self._pipe(expected.blocks), what=f"receiving transfer {transfer_id}",
                )  # fmt: skip
            finally:
                self._moving.release()
        except KvTransferError as exc:
            if name is not None:
                self.groups.retire(self._store, name)
            group = None
            _drop_frames(exc)
            raise
        finally:
            with self._lock:
                self._expected.pop(transfer_id, None)
            self._store.delete_key(key)
            self._store.delete_key(f"kvflow/ack/{transfer_id}")

    def _take_seat(self, transfer_id: str, deadline_s: float, cancel: threading.Event) -> None:
        """One of MAX_MOVING_RECEIVES seats for the payload's staging, or raise."""
        while not self._moving.acquire(timeout=_SEAT_POLL_S):
            if cancel.is_set():
                raise TransferCancelledError(f"transfer {transfer_id} cancelled")
            if time.monotonic() >= deadline_s:
                raise TransferTimeoutError(
                    f"transfer {transfer_id}: no free seat to receive into before the deadline"
                )

    def _wait_for_key(self, key: str, deadline_s: float) -> bytes | None:
        """The key's value once it is set, or None at the deadline."""
        with self._lock:
            waiter = self._idle_waiters.pop() if self._idle_waiters else None
        if waiter is None:
            waiter = dist.TCPStore(
                self._store_host, self.port, is_master=False, timeout=timedelta(seconds=30)
            )
        try:
            waiter.wait([key], timedelta(seconds=max(deadline_s - time.monotonic(), 0.001)))
            value: bytes = waiter.get(key)
        except RuntimeError:  # c10d's timeout (it logs two warnings); drop this client
            return None
        with self._lock:
            if len(self._idle_waiters) < _MAX_IDLE_WAITERS:
                self._idle_waiters.append(waiter)
        return value

    def wake(self, transfer_id: str) -> None:
        with contextlib.suppress(RuntimeError):
            self._store.set(f"kvflow/xfer/{transfer_id}", _CANCELLED)

    # -- sending (prefill side) ---------------------------------------------------------------

    def _client(self, endpoint: str, timeout_s: float) -> Any:
        with self._lock:
            client = self._clients.get(endpoint)
        if client is None:
            host, port = resolve_peer(endpoint, self._peer_allow)
            try:
                client = dist.TCPStore(
                    host, port, is_master=False, timeout=timedelta(seconds=max(timeout_s, 0.1))
                )
            except RuntimeError as exc:
                raise PeerUnreachableError(
                    f"cannot reach the KV store at {endpoint}: {exc}"
                ) from exc
            with self._lock:
                self._clients[endpoint] = client
        return client

    def send(self, target: SendTarget, blocks: TransferBlocks, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        store = self._client(target.endpoint, timeout_s)
        peer = f"{target.endpoint}/{target.decode_instance_id}"
        with self._lock:
            name = self._send_group.get(peer)
        try:
            if name is not None and store.check([f"kvflow/broken/{name}"]):
                self.groups.retire(store, name)
                name = None
            if name is None:
                name = (
                    f"{self._instance_id[:12]}-{target.decode_instance_id[:12]}-{next(self._names)}"
                )
                with self._lock:
                    self._send_group[peer] = name
            value, nonce = signed_rendezvous(self._token, target.transfer_id, name)
            store.set(f"kvflow/xfer/{target.transfer_id}", value)
        except RuntimeError as exc:
            with self._lock:
                self._clients.pop(target.endpoint, None)
            raise PeerUnreachableError(f"the KV store at {target.endpoint} failed: {exc}") from exc
        try:
            is_new = not self.groups.is_formed(name)
            if is_new and self._token is not None:
                self._check_answer(store, target, name, nonce, deadline)
            group = self.groups.group(store, name, 0, deadline, self._pipe(blocks).device)
            if _FAULT_PAUSE_S > 0:
                time.sleep(_FAULT_PAUSE_S)
            send_messages(
                group, blocks, target.tag, deadline, self._pipe(blocks),
                what=f"sending transfer {target.transfer_id}",
            )  # fmt: skip
        except KvTransferError as exc:
            with self._lock:
                if self._send_group.get(peer) == name:
                    del self._send_group[peer]
            self.groups.retire(store, name)
            group = None
            _drop_frames(exc)
            raise

    def _check_answer(
        self, store: Any, target: SendTarget, name: str, nonce: str, deadline_s: float
    ) -> None:
        """Before a new group forms: the store's owner proved the token for ``nonce``."""
        assert self._token is not None
        key = f"kvflow/ack/{target.transfer_id}"
        try:
            store.wait([key], timedelta(seconds=max(deadline_s - time.monotonic(), 0.001)))
            answer: bytes = store.get(key)
        except RuntimeError:  # c10d's timeout: this client is unusable, drop it
            with self._lock:
                if self._clients.get(target.endpoint) is store:
                    del self._clients[target.endpoint]
            answer = b""
        expected = rendezvous_answer(self._token, target.transfer_id, name, nonce)
        if not hmac.compare_digest(answer, expected):
            raise TransferRejectedError(
                f"the KV store at {target.endpoint} did not prove the pool's worker token by "
                "the transfer's deadline: no group formed, no KV sent (a reservation named an "
                "endpoint outside the pool, or the workers' tokens differ)"
            )

    def close(self) -> None:
        pass  # daemon threads and the store die with the process
