"""Keep the block index in step with one worker's KV event stream.

The worker sends a snapshot first, then numbered events. A gap in the numbering (a lost
batch), a new instance id (the worker restarted) or a broken stream all end in the same
recovery: resubscribe, and the next snapshot replaces what we knew.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.block_hash import BlockHash
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.types import WorkerId
from kvflow.router.workers.client import WorkerClient

log = logging.getLogger("kvflow.router.kv_events")

RESUBSCRIBE_AFTER_S = 0.5


class _StreamOutOfStepError(Exception):
    """The stream can no longer be trusted; start over from a snapshot."""


class KvEventFollower:
    def __init__(self, worker_id: WorkerId, client: WorkerClient, index: BlockIndex) -> None:
        self._worker_id = worker_id
        self._client = client
        self._index = index
        self._instance_id: str | None = None
        self._seq = 0
        self.num_snapshots = 0

    def _apply(self, batch: pb.KvEventBatch) -> None:
        if batch.is_snapshot:
            self._index.replace(
                self._worker_id, (BlockHash(h) for h in batch.snapshot_block_hashes)
            )
            self._instance_id, self._seq = batch.instance_id, batch.seq
            self.num_snapshots += 1
            return
        if self._instance_id is None or batch.instance_id != self._instance_id:
            raise _StreamOutOfStepError("events before a snapshot, or from another instance")
        for event in batch.events:
            if event.seq != self._seq + 1:
                raise _StreamOutOfStepError(f"event {event.seq} after {self._seq}")
            hashes = (BlockHash(h) for h in event.block_hashes)
            if event.kind == pb.KV_EVENT_KIND_STORED:
                self._index.add(self._worker_id, hashes)
            elif event.kind == pb.KV_EVENT_KIND_REMOVED:
                self._index.remove(self._worker_id, hashes)
            elif event.kind == pb.KV_EVENT_KIND_CLEARED:
                self._index.clear(self._worker_id)
            self._seq = event.seq

    async def run(self) -> None:
        """Follow the stream until cancelled, resubscribing after every failure."""
        while True:
            call = self._client.subscribe_kv_events()
            try:
                async for batch in call:
                    self._apply(batch)
                log.info("KV event stream of %s ended; resubscribing", self._worker_id)
            except _StreamOutOfStepError as exc:
                log.warning("KV events of %s: %s; resubscribing", self._worker_id, exc)
            except grpc.aio.AioRpcError as exc:
                log.debug("KV events of %s: %s", self._worker_id, exc.code())
            except Exception:
                # A bug must not silently stop following this worker: log, start over.
                log.exception("following the KV events of %s failed", self._worker_id)
            finally:
                call.cancel()
            self._instance_id = None
            await asyncio.sleep(RESUBSCRIBE_AFTER_S)
