"""What the gateway's worker pool computes for routing, without its gRPC.

``kvflow.router.workers.pool.WorkerPool`` polls each worker's Load every
``LOAD_INTERVAL_S`` and corrects the report by the requests it has started or finished
there since (``estimate_queue_depth``); ``KvEventFollower`` applies each worker's KV
events to the ``BlockIndex``. This does the same in virtual time: the polls are events on
the clock, the KV events arrive when a step ends, and the views are built the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvflow.engine_worker.core.kv_events import KvEvent, KvEventKind
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId, WorkerView
from kvflow.router.serving.admission import (
    AdmissionConfig,
    TenantLoad,
    Verdict,
    WorkerQueue,
    decide,
)
from kvflow.router.workers.load import LOAD_INTERVAL_S, estimate_queue_depth
from kvflow.sim.worker import LoadReport

__all__ = ["LOAD_INTERVAL_S", "RouterSide"]

# The virtual cluster's traffic has no tenants: never over a share.
_ONE_TENANT = TenantLoad(0, 1.0, 0, 1.0, 1)


@dataclass
class _Counters:
    role: Role
    num_reported: int = 0  # waiting + running at the last poll
    kv_usage: float = 0.0
    num_local: int = 0  # this router's open requests there
    num_local_at_report: int = 0
    num_waiting: int = 0  # at the last poll
    drain_rate_per_s: float = 0.0
    num_dispatched_since_report: int = 0
    load: LoadReport | None = None  # the last poll's, for the token fields


class RouterSide:
    def __init__(self, model: str, workers: Iterable[tuple[WorkerId, Role]]) -> None:
        self.model = model
        self.index = BlockIndex()
        self.sessions = SessionTable()
        self._workers = {worker_id: _Counters(role) for worker_id, role in workers}

    def poll(self, worker_id: WorkerId, load: LoadReport) -> None:
        """A Load answer (WorkerPool._monitor)."""
        w = self._workers[worker_id]
        w.num_reported = load.num_waiting + load.num_running
        w.kv_usage = load.kv_usage
        w.num_local_at_report = w.num_local
        w.num_waiting = load.num_waiting
        w.drain_rate_per_s = load.queue_drain_rate_per_s
        w.num_dispatched_since_report = 0
        w.load = load

    def apply_kv_events(self, worker_id: WorkerId, events: Sequence[KvEvent]) -> None:
        """A batch of the worker's KV events (KvEventFollower._apply)."""
        for event in events:
            hashes = (BlockHash(h) for h in event.block_hashes)
            if event.kind is KvEventKind.STORED:
                self.index.add(worker_id, hashes)
            elif event.kind is KvEventKind.REMOVED:
                self.index.remove(worker_id, hashes)
            else:
                self.index.clear(worker_id)

    def open(self, worker_id: WorkerId) -> None:
        self._workers[worker_id].num_local += 1

    def dispatched(self, worker_id: WorkerId) -> None:
        """A new request was sent there (admission counts it until the next poll)."""
        self._workers[worker_id].num_dispatched_since_report += 1

    def admit(self, config: AdmissionConfig) -> Verdict:
        """AdmissionControl.check over the routable workers: one tenant, so only the
        cluster-wide bounds (503) apply, never the over-share 429."""
        routable = [v.worker_id for v in self.views() if v.role is not Role.PREFILL]
        counters = [self._workers[worker_id] for worker_id in routable]
        queues = [
            WorkerQueue(worker_id, w.num_waiting, 0, w.drain_rate_per_s)
            for worker_id, w in zip(routable, counters, strict=True)
        ]
        num_dispatched = sum(w.num_dispatched_since_report for w in counters)
        return decide(queues, num_dispatched, _ONE_TENANT, config)

    def close(self, worker_id: WorkerId) -> None:
        self._workers[worker_id].num_local -= 1

    def views(self) -> list[WorkerView]:
        """WorkerPool.views: every worker healthy, serving ``model``."""
        return [
            WorkerView(
                worker_id=worker_id,
                model=self.model,
                role=w.role,
                is_healthy=True,
                queue_depth=estimate_queue_depth(
                    w.num_reported, w.num_local, w.num_local_at_report
                ),
                kv_usage=w.kv_usage,
                num_prefill_tokens=w.load.num_prefill_tokens if w.load else 0,
                num_decode_seqs=w.load.num_decode_seqs if w.load else 0,
                num_kv_tokens=w.load.num_kv_tokens if w.load else 0,
                kv_capacity_tokens=w.load.kv_capacity_tokens if w.load else 0,
                num_cached_tokens=w.load.num_cached_tokens if w.load else 0,
                load_at_s=w.load.at_s if w.load else None,
            )
            for worker_id, w in self._workers.items()
        ]
