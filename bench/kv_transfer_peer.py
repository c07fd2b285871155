"""One side of the KV transfer benchmark (bench/kv_transfer.py), run in its own process.

Each peer holds a real TorchModelRunner paged cache and one KvTransferAgent per transport
(TCP and gloo, as a worker would), plus what the raw ceiling needs: a bench-owned two-rank
gloo group and one persistent socket between the peers. The parent drives both peers
over pipes, one command at a time, and reads back timestamps of ``time.monotonic()``
(CLOCK_MONOTONIC, the same clock in both processes), so a transfer is timed from the
prefill side's gather to the decode side's scatter.

The decode side does what EngineLoop does: ``empty_blocks`` + ``agent.receive`` when the
reservation is made, then ``write_blocks`` on its own ("engine") thread after the
completion is posted back. The prefill side gathers with ``read_blocks`` on its thread
and hands the copy to ``agent.send``.
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
from kv_transfer_profile import profile_block_io, scatter_by_block
from kv_transfer_zerocopy import block_runs, recv_runs, send_runs

from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, make_transport
from kvflow.engine_worker.kv_transfer.base import KvTransportKind, SendTarget
from kvflow.engine_worker.kv_transfer.tcp import byte_view
from kvflow.engine_worker.runner import TorchModelRunner

dist: Any = _dist
# Generous: a 1 GiB transfer on two busy cores has taken 10 s; a stuck run still ends.
TRANSFER_TIMEOUT_S = 120.0
TRANSPORTS = (KvTransportKind.TCP, KvTransportKind.GLOO)
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
                kv_, heads, blocks, size, dim = kv.shape
                per_block = torch.randn((kv_, heads, blocks, 1, 1), generator=gen)
                per_slot = torch.randn((1, 1, 1, size, dim), generator=gen)
                torch.add(per_block, per_slot, out=kv)
        # Scattered block ids, as a cache that has run a while holds them; the two sides
        # draw different ones (their caches differ).
        rng = random.Random(f"{cfg.seed}-{cfg.role}")
        self.block_ids = rng.sample(range(cfg.num_cache_blocks), cfg.max_transfer_blocks)
        # One contiguous staging tensor (touched): the raw arms' payload and the "pooled"
        # arm's reused buffer.
        self.staging = self.runner.empty_blocks(cfg.max_transfer_blocks)
        self.staging.zero_()
        self.block_numel = self.staging.numel() // cfg.max_transfer_blocks
        instance = f"bench-{cfg.role}"
        self.agents = {
            kind: KvTransferAgent(
                make_transport(
                    kind, host="127.0.0.1", port=0, advertise_host="127.0.0.1", instance_id=instance
                ),
                instance_id=instance,
                max_timeout_s=TRANSFER_TIMEOUT_S,
            )
            for kind in TRANSPORTS
        }
        self.done: queue.Queue[tuple[Any, float]] = queue.Queue()  # the "engine loop" inbox
        self.group: Any = None
        self.sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._store: Any = None

    def bytes_of(self, num_blocks: int) -> int:
        return self.staging.element_size() * self.block_numel * num_blocks

    def raw_view(self, num_bytes: int) -> torch.Tensor:
        return self.staging.view(-1).view(torch.uint8)[:num_bytes]

    def pooled(self, num_blocks: int, first_layer: int = 0, num_layers: int = 0) -> torch.Tensor:
        """A contiguous, already touched buffer of ``num_blocks`` blocks of layers
        ``first_layer`` on (all by default): the staging memory reused, as a pool of staging
        buffers would be. Layer groups of one transfer lie side by side."""
        shape = list(self.staging.shape)
        shape[0] = num_layers or self.cfg.num_layers
        shape[3] = num_blocks
        layer_numel = self.block_numel // self.cfg.num_layers * num_blocks
        start = first_layer * layer_numel
        return self.staging.view(-1)[start : start + shape[0] * layer_numel].view(shape)

    def layer_groups(self, num_groups: int) -> list[range]:
        size = self.cfg.num_layers // num_groups
        return [range(g * size, (g + 1) * size) for g in range(num_groups)]

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

    # With num_groups > 1 (the "tuned" what-if, pooled buffers only) a transfer moves as
    # one message per group of layers: the sender gathers group g + 1 while group g is on
    # the wire, and the receiver scatters each group as it lands, one copy per block.

    def expect(
        self, transport: str, num_blocks: int, pooled: bool, num_groups: int, rid: str
    ) -> list[dict[str, Any]]:
        """Decode side, part 1: the reservation (receive buffers and tickets)."""
        assert pooled or num_groups == 1
        if pooled:
            buffers = [
                self.pooled(num_blocks, layers.start, len(layers))
                for layers in self.layer_groups(num_groups)
            ]
        else:
            buffers = [self.runner.empty_blocks(num_blocks)]  # what EngineLoop does
        self._pending = (buffers, num_blocks)
        agent = self.agents[KvTransportKind(transport)]
        tickets = []
        for g, buffer in enumerate(buffers):
            ticket = agent.receive(
                f"{rid}/{g}",
                buffer,
                TRANSFER_TIMEOUT_S,
                lambda err, g=g: self.done.put((g, err, time.monotonic())),
            )
            tickets.append(
                {"transfer_id": ticket.transfer_id, "tag": ticket.tag, "endpoint": ticket.endpoint}
            )
        return tickets

    def land(self, verify: bool) -> dict[str, Any]:
        """Decode side, part 2: wait for each completion, scatter into the cache."""
        buffers, num_blocks = self._pending
        ids = self.block_ids[:num_blocks]
        groups = self.layer_groups(len(buffers))
        recv_done = 0.0
        for _ in buffers:
            g, error, recv_done = self.done.get(timeout=TRANSFER_TIMEOUT_S + 5)
            if error is not None:
                raise RuntimeError(f"receive failed: {error}")
            if len(buffers) == 1:
                self.runner.write_blocks(ids, buffers[0])  # kvflow's scatter
                continue
            with torch.inference_mode():
                for layer, data in zip(groups[g], buffers[g], strict=True):
                    scatter_by_block(self.runner.kv_caches[layer], ids, data)
        out = {"recv_done": recv_done, "scatter_end": time.monotonic()}
        if verify:
            out["checksum"] = self.checksum(num_blocks)
        del self._pending
        return out

    def send(
        self, transport: str, num_blocks: int, pooled: bool, tickets: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Prefill side: gather the blocks, send them, wait for the sends to end."""
        ids = self.block_ids[:num_blocks]
        idx = torch.tensor(ids, dtype=torch.int64)
        agent = self.agents[KvTransportKind(transport)]
        sent: queue.Queue[Any] = queue.Queue()
        gather_start = time.monotonic()
        for ticket, layers in zip(tickets, self.layer_groups(len(tickets)), strict=True):
            if pooled:
                data = self.pooled(num_blocks, layers.start, len(layers))
                for i, layer in enumerate(layers):
                    torch.index_select(self.runner.kv_caches[layer], 2, idx, out=data[i])
            else:
                data = self.runner.read_blocks(ids)  # kvflow's gather
            target = SendTarget(
                ticket["transfer_id"], ticket["endpoint"], ticket["tag"], "bench-decode"
            )
            agent.send(target, data, TRANSFER_TIMEOUT_S, sent.put)
        gather_end = time.monotonic()
        for _ in tickets:
            result = sent.get(timeout=TRANSFER_TIMEOUT_S + 5)
            if not hasattr(result, "transfer_s"):
                raise RuntimeError(f"send failed: {result}")
        return {"gather_start": gather_start, "gather_end": gather_end}

    # -- a tiny transfer: what a transfer costs beyond its bytes ------------------------------

    def expect_tiny(self, transport: str, rid: str) -> dict[str, Any]:
        self._tiny = torch.zeros(TINY_BYTES, dtype=torch.uint8)
        agent = self.agents[KvTransportKind(transport)]
        ticket = agent.receive(
            rid, self._tiny, TRANSFER_TIMEOUT_S, lambda err: self.done.put((err, time.monotonic()))
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
        self.agents[KvTransportKind(transport)].send(target, data, TRANSFER_TIMEOUT_S, sent.put)
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
            blocks = kv.index_select(2, idx).double()
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

    # -- the zero-copy what-if (vectored I/O straight from and into the caches) ------------

    def zerocopy_recv(self, num_blocks: int, conn: Connection) -> float:
        assert self.sock is not None
        runs = block_runs(self.runner.kv_caches, self.block_ids[:num_blocks])
        conn.send(("ready", None))
        recv_runs(self.sock, runs)
        return time.monotonic()

    def zerocopy_send(self, num_blocks: int) -> float:
        assert self.sock is not None
        started = time.monotonic()
        send_runs(self.sock, block_runs(self.runner.kv_caches, self.block_ids[:num_blocks]))
        return started

    def profile(self, num_blocks: int, reps: int) -> dict[str, float]:
        return profile_block_io(
            self.runner, self.block_ids[:num_blocks], self.pooled(num_blocks), reps
        )


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
            if name in ("raw_recv", "zerocopy_recv"):
                kwargs["conn"] = conn
            conn.send(("ok", getattr(peer, name)(**kwargs)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
