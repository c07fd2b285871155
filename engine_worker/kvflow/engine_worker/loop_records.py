"""What the engine loop hands across threads: typed records, the KV-event subscription, and
the runner's whole-block access it needs for PD. No logic beyond a subscription's queue."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.core.kv_events import KvEvent
from kvflow.engine_worker.kv_transfer.agent import SendStats, Ticket
from kvflow.proto.block_hash import BlockHash


class BlockIO(Protocol):
    """The runner's whole-block access (TorchModelRunner, SimulatedRunner)."""

    kv_layout: str

    def empty_blocks(self, num_blocks: int) -> Any: ...

    def read_blocks(self, block_ids: Sequence[int]) -> Any: ...

    def write_blocks(self, block_ids: Sequence[int], data: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class KvReservationOut:
    """A decode-side request's first stream item: the blocks it waits for and where a
    prefill worker sends them (no ticket: it lacks nothing a prefill worker could send)."""

    request_id: str
    first_token: int
    end_token: int
    ticket: Ticket | None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    output: RequestOutput  # the final one: usage and timings
    num_sent_blocks: int
    send: SendStats


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_cached_blocks: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_hit_rate: float = 0.0
    num_kv_transfers: int = 0
    # The load in tokens (LoadResponse): prompt tokens not computed yet, requests past
    # their prompt, the KV tokens those hold.
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    seq: int
    block_hashes: list[BlockHash]


@dataclass(eq=False)
class KvSubscription:
    """What one subscriber has yet to read: a snapshot first, then event batches."""

    loop: asyncio.AbstractEventLoop
    pending: deque[KvSnapshot | list[KvEvent]] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    needs_snapshot: bool = True

    def push(self, item: KvSnapshot | list[KvEvent]) -> None:
        self.pending.append(item)
        self.loop.call_soon_threadsafe(self.wakeup.set)

    async def next(self) -> KvSnapshot | list[KvEvent]:
        while not self.pending:
            self.wakeup.clear()
            if not self.pending:
                await self.wakeup.wait()
        return self.pending.popleft()


StepObserver = Callable[[Engine, list[RequestOutput], float], None]


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """How one KV transfer ended, for metrics: ``outcome`` is "ok" or the error's kind."""

    direction: str  # "send" or "receive"
    outcome: str
    num_bytes: int
    seconds: float


TransferObserver = Callable[[TransferRecord], None]
