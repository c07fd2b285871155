"""The gloo and nccl transports' peer check: a mutual HMAC challenge-response over a new
pair group, with the pool's worker token, before the group carries any KV.

Why over the group, not the store: the rendezvous store (a TCPStore on the decode worker's
KV port) has no authentication of its own, and anyone who reaches it can write a
transfer's key or a group's rendezvous keys (transfer ids are `<instance>-<number>`, easy
to guess) and so take a rank of a group the receiver or the sender then joins. Proving the
token inside the formed group checks the party at the other end of the group's own
connections (gloo's pair sockets, NCCL's communicator), which are fixed once formed, so
every later transfer on the cached group comes from, and goes to, the peer that proved it.

Each side sends a fresh 32-byte nonce, then HMAC-SHA256 under the token of
(protocol, its role, the group's name, both nonces); each checks the other's. A peer that
cannot answer, or answers wrong, is refused before a byte of KV moves either way.

What it does not do (see also auth.py): encrypt, or
authenticate each message after formation (an attacker who can inject into an established
TCP connection is on the path and could read the KV anyway: use a mesh with mTLS there),
or keep anyone from the store itself: deleting or overwriting keys still fails transfers
(each then falls back to a local prefill). The pool's NetworkPolicy is what limits that.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import torch

from kvflow.engine_worker.kv_transfer.base import TransferRejectedError, TransferTimeoutError
from kvflow.engine_worker.kv_transfer.pipeline import wait_work

PROTOCOL = b"kvflow-kv-group-v1"
NONCE_BYTES = 32
MAC_BYTES = 32
# gloo and NCCL tags are C ints. Transfer messages use tag | index << 20 (pipeline.py),
# which can reach this value too, but only in a transfer that starts after the handshake
# on the same pair; messages of one (peer, tag) arrive in the order sent, so the
# handshake's are always matched first.
HANDSHAKE_TAG = 2**31 - 1
ROLES = (b"sender", b"receiver")  # rank 0 sends KV, rank 1 receives it


def group_mac(token: str, role: bytes, name: str, nonce_0: bytes, nonce_1: bytes) -> bytes:
    """What the rank with ``role`` proves: the token, bound to this group and both nonces."""
    message = b"\0".join((PROTOCOL, role, name.encode(), nonce_0, nonce_1))
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


class HandshakeRefusedError(TransferRejectedError):
    """The peer of a new KV group did not prove the pool's worker token.

    ``is_idle``: its operations all completed (a wrong answer), so the group may be
    dropped at once; otherwise (no answer) one may still be pending in it."""

    def __init__(self, message: str, *, is_idle: bool) -> None:
        super().__init__(message)
        self.is_idle = is_idle


def _exchange(
    group: Any, rank: int, mine: bytes, size: int, deadline_s: float, device: torch.device,
    what: str,
) -> bytes:  # fmt: skip
    """Send ``mine`` to the other rank and receive ``size`` bytes from it."""
    peer = 1 - rank
    out = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    into = torch.zeros(size, dtype=torch.uint8, device=device)
    receiving = group.recv([into], peer, HANDSHAKE_TAG)
    sending = group.send([out], peer, HANDSHAKE_TAG)
    wait_work(sending, deadline_s, what, device)
    wait_work(receiving, deadline_s, what, device)
    return bytes(into.cpu().numpy().tobytes())


def prove_peer(
    group: Any, name: str, rank: int, token: str, deadline_s: float, device: torch.device
) -> None:
    """Run the handshake as ``rank`` of the new pair ``group``; raise HandshakeRefusedError
    unless the other rank proved the token by ``deadline_s``."""
    what = f"the KV group {name} handshake"
    nonce = os.urandom(NONCE_BYTES)
    try:
        peer_nonce = _exchange(group, rank, nonce, NONCE_BYTES, deadline_s, device, what)
        nonces = (nonce, peer_nonce) if rank == 0 else (peer_nonce, nonce)
        mac = group_mac(token, ROLES[rank], name, *nonces)
        peer_mac = _exchange(group, rank, mac, MAC_BYTES, deadline_s, device, what)
    except TransferTimeoutError as exc:
        raise HandshakeRefusedError(
            f"{what}: the peer did not answer by the transfer's deadline (it has no worker "
            "token, or is no kvflow worker)",
            is_idle=False,
        ) from exc
    if not hmac.compare_digest(peer_mac, group_mac(token, ROLES[1 - rank], name, *nonces)):
        raise HandshakeRefusedError(
            f"{what}: the peer's answer does not prove the pool's worker token "
            "(KVFLOW_WORKER_TOKEN differs, or an outsider joined the group)",
            is_idle=True,
        )


# -- the rendezvous keys, before any group forms ----------------------------------------
#
# A sender's ``kvflow/xfer/<transfer id>`` value names the group to form; under a token it
# carries a fresh nonce and a MAC of (transfer id, group name, nonce), and the receiver
# refuses a value without a valid one before it joins any group: an outsider who reaches
# the store cannot make a decode worker join a group of its choosing. The receiver answers
# with ``kvflow/ack/<transfer id>``, its own MAC for the same nonce, and a sender forms a new
# group only once it checked that answer: a reservation naming an endpoint outside the
# pool (anyone's TCPStore) gets no group and no KV. The handshake above still runs inside
# every new group: it binds the proof to the group's own connections.

RENDEZVOUS_PROTOCOL = b"kvflow-kv-rendezvous-v1"


def rendezvous_mac(token: str, role: bytes, transfer_id: str, name: str, nonce: str) -> bytes:
    message = b"\0".join(
        (RENDEZVOUS_PROTOCOL, role, transfer_id.encode(), name.encode(), nonce.encode())
    )
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def signed_rendezvous(token: str | None, transfer_id: str, name: str) -> tuple[bytes, str]:
    """The sender's key value for a transfer, and its nonce."""
    nonce = os.urandom(NONCE_BYTES // 2).hex()
    mac = "" if token is None else rendezvous_mac(token, ROLES[0], transfer_id, name, nonce).hex()
    return f"{name}\n{nonce}\n{mac}".encode(), nonce


def check_rendezvous(token: str | None, transfer_id: str, value: bytes) -> tuple[str, str]:
    """The group name and nonce of a sender's key value; raises TransferRejectedError
    when a token is set and the value does not prove it."""
    try:
        name, nonce, mac = value.decode().split("\n")
        given = bytes.fromhex(mac)
    except ValueError as exc:
        raise TransferRejectedError(f"transfer {transfer_id}: a malformed rendezvous key") from exc
    if token is not None and not hmac.compare_digest(
        given, rendezvous_mac(token, ROLES[0], transfer_id, name, nonce)
    ):
        raise TransferRejectedError(
            f"transfer {transfer_id}: its rendezvous key does not prove the pool's worker "
            "token (KVFLOW_WORKER_TOKEN differs, or an outsider wrote it); no group formed"
        )
    return name, nonce


def rendezvous_answer(token: str, transfer_id: str, name: str, nonce: str) -> bytes:
    """The receiver's ``kvflow/ack`` value: its proof for the sender's nonce."""
    return rendezvous_mac(token, ROLES[1], transfer_id, name, nonce)
