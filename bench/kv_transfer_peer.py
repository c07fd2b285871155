"""One side of the KV transfer benchmark (bench/kv_transfer.py), run in its own process.

Each peer holds a real TorchModelRunner paged cache and one KvTransferAgent per transport
(TCP and gloo, as a worker would), plus what the raw ceiling needs: a bench-owned two-rank
gloo group and one persistent socket between the peers. The parent drives both peers
over pipes, one command at a time, and reads back timestamps of ``time.monotonic()``
(CLOCK_MONOTONIC, the same clock in both processes), so a transfer is timed from the
prefill side's gather to the decode side's scatter.

The decode side does what EngineLoop does: ``transfer_blocks`` of the reserved blocks and
``agent.receive`` when the reservation is made; the transport writes them in place and the
completion is posted back to the peer's own ("engine") thread. The prefill side hands
``transfer_blocks`` of its blocks to ``agent.send``, which reads them in place.
"""

from __future__ import annotations

import queue
import random
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as _dist
from kv_transfer_profile import profile_block_io

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.kv_transfer.blocks import TransferBlocks
from kvflow.engine_worker.kv_transfer.tcp import TcpTransport
from kvflow.engine_worker.kv_transfer.tcp_stream import byte_view
from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls
from kvflow.engine_worker.runner import TorchModelRunner
from kvflow.proto.transports import KvTransport

dist: Any = _dist
# Generous: a 1 GiB transfer on two busy cores has taken 10 s; a stuck run still ends.
TRANSFER_TIMEOUT_S = 120.0
TRANSPORTS = (KvTransport.TCP, KvTransport.GLOO)
TINY_BYTES = 16


@dataclass(frozen=True)
class PeerConfig:
    role: str  # "prefill" (sends) or "decode" (receives)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_cache_blocks: int
    max_transfer_blocks: int
    dtype: str
    seed: int
    tls_dir: str = ""  # set: a TCP agent with mutual TLS from ca.pem, server.pem/.key there


class Peer:
    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.runner = TorchModelRunner(
            None,  # type: ignore[arg-type]  # only the cache and its block I/O are used
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            num_blocks=cfg.num_cache_blocks,
            block_size=cfg.block_size,
            dtype=getattr(torch, cfg.dtype),
        )
        if cfg.role == "prefill":
            gen = torch.Generator().manual_seed(cfg.seed)
            for kv in self.runner.kv_caches:
                # Distinct per block and per position in a block (a misplaced block or
                # a shifted byte changes the checksum), without a 1 GiB randn.
                blocks, *block_shape = kv.shape  # [blocks, block_size, 2, kv_heads, head_dim]
                per_block = torch.randn((blocks, 1, 1, 1, 1), generator=gen)
                per_slot = torch.randn((1, *block_shape), generator=gen)
                torch.add(per_block, per_slot, out=kv)
        # Scattered block ids, as a cache that has run a while holds them; the two sides
        # draw different ones (their caches differ).
        rng = random.Random(f"{cfg.seed}-{cfg.role}")
        self.block_ids = rng.sample(range(cfg.num_cache_blocks), cfg.max_transfer_blocks)
        # One contiguous tensor (touched): the raw arms' payload.
        self.staging = self.runner.empty_blocks(cfg.max_transfer_blocks)
        self.staging.zero_()
        self.block_numel = self.staging.numel() // cfg.max_transfer_blocks
        instance = f"bench-{cfg.role}"
        self.agents: dict[str, KvTransferAgent] = {
            kind.value: KvTransferAgent(
                make_transport(
                    kind, host="127.0.0.1", port=0, advertise_host="127.0.0.1", instance_id=instance
                ),
                instance_id=instance,
                max_timeout_s=TRANSFER_TIMEOUT_S,
            )
            for kind in TRANSPORTS
        }
        # The what-if: TCP through 16 MiB host staging messages, the path of a CUDA cache.
        staged = TcpTransport("127.0.0.1", 0, "127.0.0.1", is_in_place=False)
        self.agents["staged-tcp"] = KvTransferAgent(
            staged, instance_id=instance, max_timeout_s=TRANSFER_TIMEOUT_S
        )
        if cfg.tls_dir:  # the what-if: TCP with mutual TLS (--kv-tls), in place
            d = cfg.tls_dir
            kv_tls = KvTls.from_files(f"{d}/server.pem", f"{d}/server.key", f"{d}/ca.pem")
            self.agents["tls-tcp"] = KvTransferAgent(
                TcpTransport("127.0.0.1", 0, "127.0.0.1", tls=kv_tls),
                instance_id=instance,
                max_timeout_s=TRANSFER_TIMEOUT_S,
            )
        self.done: queue.Queue[tuple[Any, float]] = queue.Queue()  # the "engine loop" inbox
        self.group: Any = None
        self.sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._store: Any = None

    def bytes_of(self, num_blocks: int) -> int:
        return self.staging.element_size() * self.block_numel * num_blocks

    def raw_view(self, num_bytes: int) -> torch.Tensor:
        return self.staging.view(-1).view(torch.uint8)[:num_bytes]

    # -- setup -------------------------------------------------------------------------------

    def endpoints(self) -> dict[str, Any]:
        """Decode side: open the raw arms' store and socket; say where everything listens."""
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._listener = socket.create_server(("127.0.0.1", 0))
        return {
            "store_port": self._store.port,
            "sock_port": self._listener.getsockname()[1],
        }

    def connect_raw(self, store_port: int = 0, sock_port: int = 0) -> dict[str, Any]:
        """Both sides: form the raw gloo group and the raw socket (timed: a pair's setup)."""
        started = time.monotonic()
        if self.cfg.role == "prefill":
            self._store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
        rank = 0 if self.cfg.role == "prefill" else 1
        prefixed = dist.PrefixStore("bench/raw/", self._store)
        self.group = dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(seconds=60))
        group_s = time.monotonic() - started
        if self.cfg.role == "prefill":
            self.sock = socket.create_connection(("127.0.0.1", sock_port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            assert self._listener is not None
            self.sock, _ = self._listener.accept()
        return {"raw_group_s": group_s}

    # -- kvflow's path -------------------------------------------------------------------------

    def expect(self, transport: str, num_blocks: int, rid: str) -> dict[str, Any]:
        """Decode side, part 1: the reservation (the blocks to land in, and a ticket)."""
        blocks = self.runner.transfer_blocks(self.block_ids[:num_blocks])
        ticket = self.agents[transport].receive(
            rid, blocks, TRANSFER_TIMEOUT_S, lambda err: self.done.put((err, time.monotonic()))
        )
        return {"transfer_id": ticket.transfer_id, "tag": ticket.tag, "endpoint": ticket.endpoint}

    def land(self, num_blocks: int, verify: bool) -> dict[str, Any]:
        """Decode side, part 2: the completion, handled on this ("engine") thread."""
        error, recv_done = self.done.get(timeout=TRANSFER_TIMEOUT_S + 5)
        if error is not None:
            raise RuntimeError(f"receive failed: {error}")
        out = {"recv_done": recv_done, "scatter_end": time.monotonic()}
        if verify:
            out["checksum"] = self.checksum(num_blocks)
        return out

    def send(
        self, transport: str, num_blocks: int, rid: str, ticket: dict[str, Any]
    ) -> dict[str, Any]:
        """Prefill side: hand the blocks to the agent, wait for the send to end."""
        sent: queue.Queue[Any] = queue.Queue()
        gather_start = time.monotonic()
        blocks = self.runner.transfer_blocks(self.block_ids[:num_blocks])
        target = SendTarget(
            ticket["transfer_id"], ticket["endpoint"], ticket["tag"], "bench-decode"
        )
        gather_end = time.monotonic()
        self.agents[transport].send(rid, target, blocks, TRANSFER_TIMEOUT_S, sent.put)
        result = sent.get(timeout=TRANSFER_TIMEOUT_S + 5)
        if not hasattr(result, "transfer_s"):
            raise RuntimeError(f"send failed: {result}")
        return {"gather_start": gather_start, "gather_end": gather_end}

    # -- a tiny transfer: what a transfer costs beyond its bytes ------------------------------

    def expect_tiny(self, transport: str, rid: str) -> dict[str, Any]:
        self._tiny = torch.zeros(TINY_BYTES, dtype=torch.uint8)
        ticket = self.agents[transport].receive(
            rid,
            TransferBlocks.of_buffer(self._tiny),
            TRANSFER_TIMEOUT_S,
            lambda err: self.done.put((err, time.monotonic())),
        )
        return {"transfer_id": ticket.transfer_id, "tag": ticket.tag, "endpoint": ticket.endpoint}

    def land_tiny(self) -> float:
        error, recv_done = self.done.get(timeout=TRANSFER_TIMEOUT_S + 5)
        if error is not None:
            raise RuntimeError(f"tiny receive failed: {error}")
        assert bool((self._tiny == 7).all()), "the tiny payload did not arrive"
        return float(recv_done)

    def send_tiny(self, transport: str, ticket: dict[str, Any]) -> float:
        data = torch.full((TINY_BYTES,), 7, dtype=torch.uint8)
        target = SendTarget(
            ticket["transfer_id"], ticket["endpoint"], ticket["tag"], "bench-decode"
        )
        sent: queue.Queue[Any] = queue.Queue()
        started = time.monotonic()
        blocks = TransferBlocks.of_buffer(data)
        self.agents[transport].send("tiny", target, blocks, TRANSFER_TIMEOUT_S, sent.put)
        result = sent.get(timeout=TRANSFER_TIMEOUT_S + 5)
        if not hasattr(result, "transfer_s"):
            raise RuntimeError(f"tiny send failed: {result}")
        return started

    def checksum(self, num_blocks: int) -> list[float]:
        """Per-layer weighted sums of the transferred blocks as they sit in this side's cache,
        in transfer order: the same seeded weights on both sides, one per element, so a block
        scattered to the wrong id or a shifted element changes the sum (a plain sum would
        not see a permutation)."""
        idx = torch.tensor(self.block_ids[:num_blocks], dtype=torch.int64)
        sums = []
        weights = None
        for kv in self.runner.kv_caches:
            blocks = kv.index_select(0, idx).double()
            if weights is None:
                gen = torch.Generator().manual_seed(1234)
                weights = torch.rand(blocks.shape, generator=gen, dtype=torch.float64)
            sums.append(float((blocks * weights).sum()))
        return sums

    # -- the raw ceiling ---------------------------------------------------------------------

    def raw_recv(self, backend: str, num_bytes: int, tag: int, conn: Connection) -> float:
        view = self.raw_view(num_bytes)
        if backend == "gloo":
            work = self.group.recv([view], 0, tag)
            conn.send(("ready", None))
            work.wait()
            return time.monotonic()
        assert self.sock is not None
        mem = byte_view(view)
        conn.send(("ready", None))
        received = 0
        while received < num_bytes:
            n = self.sock.recv_into(mem[received:])
            if n == 0:
                raise ConnectionError("raw socket closed")
            received += n
        return time.monotonic()

    def raw_send(self, backend: str, num_bytes: int, tag: int) -> float:
        view = self.raw_view(num_bytes)
        started = time.monotonic()
        if backend == "gloo":
            self.group.send([view], 1, tag).wait()
        else:
            assert self.sock is not None
            self.sock.sendall(byte_view(view))
        return started

    def profile(self, num_blocks: int, reps: int) -> dict[str, float]:
        return profile_block_io(self.runner, self.block_ids[:num_blocks], self.staging, reps)


def run_peer(cfg: PeerConfig, conn: Connection) -> None:
    """The peer's command loop: (name, kwargs) in, ("ok", result) or ("error", text) out."""
    try:
        peer = Peer(cfg)
        info = {
            "bytes_per_block": peer.bytes_of(1),
            "torch": torch.__version__,
            "torch_threads_per_peer": torch.get_num_threads(),
        }
        conn.send(("ok", info))
        while True:
            name, kwargs = conn.recv()
            if name == "stop":
                conn.send(("ok", None))
                return
            if name == "raw_recv":
                kwargs["conn"] = conn
            conn.send(("ok", getattr(peer, name)(**kwargs)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
