"""The ways a prefill worker ships KV blocks to a decode worker: one list for the worker's
``--kv-transport``, the wire's ``KvTransport`` enum and the CRD's ``kvTransport``."""

from __future__ import annotations

import enum

from kvflow.proto import worker_pb2 as pb


class KvTransport(enum.StrEnum):
    TCP = "tcp"  # a plain TCP stream (optionally mutual TLS): works everywhere
    GLOO = "gloo"  # torch.distributed gloo, one process group per worker pair (CPU)
    NCCL = "nccl"  # torch.distributed NCCL: CUDA tensors, RDMA where the fabric has it

    def to_pb(self) -> pb.KvTransport:
        return _TO_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> KvTransport | None:
        """The transport a worker announces; None for an unset one."""
        return _FROM_PB.get(value)


_TO_PB: dict[KvTransport, pb.KvTransport] = {
    KvTransport.TCP: pb.KV_TRANSPORT_TCP,
    KvTransport.GLOO: pb.KV_TRANSPORT_GLOO,
    KvTransport.NCCL: pb.KV_TRANSPORT_NCCL,
}
_FROM_PB: dict[int, KvTransport] = {int(v): k for k, v in _TO_PB.items()}

AUTO = "auto"
KV_TRANSPORT_CHOICES: tuple[str, ...] = (AUTO, *(t.value for t in KvTransport))
"""What ``--kv-transport`` and the CRD accept: ``auto`` picks nccl on CUDA, tcp elsewhere."""
