"""PD on the engine thread: a request's KV blocks handed to and from the transfer agent.

A decode-side reservation hands its reserved blocks to a receive and gets a ticket
(published to the request's stream); a prefill-side request whose blocks are computed has
them sent. Transfers read and write the cache in place on their own threads and end with
a command posted back to the engine thread, like any other. Split from ``engine_loop``:
the loop owns the thread, ``request_streams`` the streams, this the handoff's state and
its steps. Every method runs on the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.core.request import KvBlockRange
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, SendStats
from kvflow.engine_worker.kv_transfer.base import KvTransferError, SendTarget
from kvflow.engine_worker.kv_transfer.blocks import InPlaceBlockIO, TransferBlocks
from kvflow.engine_worker.loop_records import (
    BlockIO,
    KvReservationOut,
    TransferObserver,
    TransferRecord,
)

log = logging.getLogger(__name__)


class KvHandoff:
    def __init__(
        self,
        engine: Engine,
        kv: KvTransferAgent,
        blocks: BlockIO,
        *,
        on_transfer: TransferObserver | None,
        post: Callable[[str, Callable[[], None]], None],
        push: Callable[[str, object], None],
        deliver: Callable[[RequestOutput], None],
    ) -> None:
        """``post`` queues a command about one request for the engine thread (if it raises,
        that request fails, nothing else); ``push`` hands an item to a request's stream;
        ``deliver`` hands it a RequestOutput (the loop's own)."""
        self.engine = engine
        self.kv = kv
        self.blocks = blocks
        self.on_transfer = on_transfer
        self._post, self._push, self._deliver = post, push, deliver
        self.remote_timeouts: dict[str, float] = {}  # decode: request id -> seconds
        self.send_targets: dict[str, tuple[SendTarget, float]] = {}  # prefill

    def forget(self, request_id: str) -> None:
        """The request is gone (refused or aborted): drop what it was waiting to use."""
        self.remote_timeouts.pop(request_id, None)
        self.send_targets.pop(request_id, None)

    def _blocks_to_receive(
        self, block_ids: Sequence[int]
    ) -> tuple[TransferBlocks, Callable[[], None]]:
        """Where a transfer lands, and what this thread does once it has landed."""
        runner = self.blocks
        if isinstance(runner, InPlaceBlockIO):
            return runner.transfer_blocks(block_ids), lambda: None
        buffer = runner.empty_blocks(len(block_ids))
        return TransferBlocks.of_buffer(buffer), lambda: runner.write_blocks(block_ids, buffer)

    def _blocks_to_send(self, block_ids: Sequence[int]) -> TransferBlocks:
        if isinstance(self.blocks, InPlaceBlockIO):
            return self.blocks.transfer_blocks(block_ids)
        return TransferBlocks.of_buffer(self.blocks.read_blocks(block_ids))

    def on_reserved(self, request_id: str, kv_range: KvBlockRange) -> None:
        timeout_s = self.remote_timeouts.pop(request_id, 0.0)
        if not kv_range.block_ids:
            reservation = KvReservationOut(
                request_id, kv_range.first_token, kv_range.end_token, None
            )
            self._push(request_id, reservation)
            return
        blocks, land = self._blocks_to_receive(kv_range.block_ids)
        started_s = time.perf_counter()

        def on_done(error: KvTransferError | None) -> None:
            self._observe("receive", error, blocks.num_bytes, time.perf_counter() - started_s)
            self._post(request_id, lambda: self._on_received(request_id, kv_range, land, error))

        ticket = self.kv.receive(request_id, blocks, timeout_s, on_done)
        self._push(
            request_id,
            KvReservationOut(request_id, kv_range.first_token, kv_range.end_token, ticket),
        )

    def _on_received(
        self,
        request_id: str,
        kv_range: KvBlockRange,
        land: Callable[[], None],
        error: KvTransferError | None,
    ) -> None:
        request = self.engine.scheduler.waiting_for_kv.get(request_id)
        if request is None or request.kv_range != kv_range:
            return  # aborted meanwhile: its blocks are already free
        if error is None:
            land()
            self.engine.remote_kv_landed(request_id)
            return
        log.warning("request %s: no remote KV (%s); computing the prompt here", request_id, error)
        self.engine.remote_kv_failed(request_id)

    def on_kv_ready(self, request_id: str, kv_range: KvBlockRange) -> None:
        entry = self.send_targets.pop(request_id, None)
        if entry is None:  # a bug: the loop fails this request alone
            raise RuntimeError(f"request {request_id!r} has computed KV but no send target")
        target, timeout_s = entry
        blocks = self._blocks_to_send(kv_range.block_ids)

        def on_done(result: SendStats | KvTransferError) -> None:
            self._post(request_id, lambda: self._on_sent(request_id, result))

        self.kv.send(request_id, target, blocks, timeout_s, on_done)

    def _observe(
        self, direction: str, error: KvTransferError | None, num_bytes: int, s: float
    ) -> None:
        if self.on_transfer is not None:
            num_bytes = 0 if error is not None else num_bytes
            outcome = "ok" if error is None else error.kind
            self.on_transfer(TransferRecord(direction, outcome, num_bytes, s))

    def _on_sent(self, request_id: str, result: SendStats | KvTransferError) -> None:
        if self.on_transfer is not None:
            if isinstance(result, SendStats):
                record = TransferRecord("send", "ok", result.num_bytes, result.transfer_s)
            else:
                record = TransferRecord("send", result.kind, 0, 0.0)
            self.on_transfer(record)
        if isinstance(result, KvTransferError):
            log.warning("request %s: sending KV failed: %s", request_id, result)
        out = self.engine.complete_kv_send(request_id, is_sent=isinstance(result, SendStats))
        if out is None:
            return  # aborted meanwhile
        self._push(request_id, result)  # an error is raised in the caller
        self._deliver(out)
