"""One side of a KV transfer between two processes on one device, through kvflow's own
KvTransferAgent and transports (the API the workers use; nothing here changes it).

The parent (gpu/kv_transfer.py) drives a "decode" peer that receives and a "prefill" peer
that sends, one command at a time over a pipe; times are ``time.monotonic()``, one clock
for both processes. Each peer holds a TorchModelRunner paged cache on the device; the
prefill side's blocks hold values distinct per block and per slot, and a transfer is
checked by per-(layer, block) sums taken in transfer order on both sides.

On CUDA the receiver synchronizes the device before it reports the end: an NCCL receive
returns once the copy is queued on the device, not once it is done.
"""

from __future__ import annotations

import queue
import random
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.runner import TorchModelRunner
from kvflow.proto.transports import KvTransport


@dataclass(frozen=True)
class PeerSpec:
    role: str  # "prefill" sends, "decode" receives
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_cache_blocks: int
    transports: tuple[str, ...]
    timeout_s: float
    seed: int


class Peer:
    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        self.runner = TorchModelRunner(
            None,  # type: ignore[arg-type]  # the cache and its block I/O only
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_blocks=spec.num_cache_blocks,
            block_size=spec.block_size,
            dtype=getattr(torch, spec.dtype),
            device=spec.device,
        )
        if spec.role == "prefill":
            fill_distinct_(self.runner.kv_caches, spec.seed)
        self.rng = random.Random(f"{spec.seed}-{spec.role}")
        self.agents: dict[str, KvTransferAgent] = {}
        for name in spec.transports:
            transport = make_transport(
                KvTransport(name),
                host="127.0.0.1",
                port=0,
                advertise_host="127.0.0.1",
                instance_id=spec.role,
            )
            self.agents[name] = KvTransferAgent(
                transport, instance_id=spec.role, max_timeout_s=spec.timeout_s
            )
        self.done: queue.Queue[Any] = queue.Queue()
        self.ids: list[int] = []

    def sync(self) -> None:
        if self.spec.device.startswith("cuda"):
            torch.cuda.synchronize()

    def pick(self, num_blocks: int) -> list[int]:
        self.ids = self.rng.sample(range(self.spec.num_cache_blocks), num_blocks)
        return self.ids

    def checksum(self) -> list[float]:
        ids = torch.tensor(self.ids, device=self.runner.kv_caches[0].device)
        sums = [
            kv.index_select(0, ids).double().sum(dim=(1, 2, 3, 4)) for kv in self.runner.kv_caches
        ]
        return [float(x) for x in torch.cat(sums).tolist()]

    # -- commands ------------------------------------------------------------------------

    def expect(self, transport: str, num_blocks: int, rid: str) -> dict[str, Any]:
        blocks = self.runner.transfer_blocks(self.pick(num_blocks))
        ticket = self.agents[transport].receive(rid, blocks, self.spec.timeout_s, self.done.put)
        return {"transfer_id": ticket.transfer_id, "endpoint": ticket.endpoint, "tag": ticket.tag}

    def land(self) -> dict[str, Any]:
        error = self.done.get(timeout=self.spec.timeout_s + 5)
        self.sync()
        landed = time.monotonic()
        if error is not None:
            return {"error": f"{type(error).__name__}: {error}", "landed": landed}
        return {"error": None, "landed": landed, "checksum": self.checksum()}

    def send(
        self, transport: str, num_blocks: int, ticket: dict[str, Any], rid: str
    ) -> dict[str, Any]:
        blocks = self.runner.transfer_blocks(self.pick(num_blocks))
        target = SendTarget(ticket["transfer_id"], ticket["endpoint"], ticket["tag"], "decode")
        self.sync()
        started = time.monotonic()
        self.agents[transport].send(rid, target, blocks, self.spec.timeout_s, self.done.put)
        result = self.done.get(timeout=self.spec.timeout_s + 5)
        self.sync()
        error = None if hasattr(result, "num_bytes") else f"{type(result).__name__}: {result}"
        return {"started": started, "error": error, "num_bytes": blocks.num_bytes}


def fill_distinct_(kv_caches: list[torch.Tensor], seed: int) -> None:
    """Values distinct per block and per slot: a misplaced block or shifted run shows."""
    gen = torch.Generator().manual_seed(seed)
    for kv in kv_caches:
        blocks, *block_shape = kv.shape  # [blocks, block_size, 2, kv_heads, head_dim]
        per_block = torch.randn((blocks, 1, 1, 1, 1), generator=gen)
        per_slot = torch.randn((1, *block_shape), generator=gen)
        kv.copy_((per_block + per_slot).to(kv.dtype))


def serve(spec: PeerSpec, conn: Connection) -> None:
    """The peer process: build, say ready, then answer commands until "stop"."""
    try:
        peer = Peer(spec)
        conn.send(("ok", "ready"))
    except Exception:  # reported to the parent, which records it
        conn.send(("error", traceback.format_exc()[-3000:]))
        return
    while True:
        name, kwargs = conn.recv()
        if name == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(peer, name)(**kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()[-3000:]))
