"""What the gateway's worker pool computes for routing, without its gRPC.

``kvflow.router.workers.pool.WorkerPool`` polls each worker's Load every
``LOAD_INTERVAL_S`` and records the answers in a ``WorkerBook``, which corrects each report
by the requests this router has started or finished there since; ``KvEventFollower``
applies each worker's KV events to the ``BlockIndex``. This feeds the same book in virtual
time: the polls are events on the clock, the KV events arrive when a step ends, and the
views and the admission queues come from the book as the gateway's do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvflow.engine_worker.core.kv_events import KvEvent, KvEventKind
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId, WorkerView
from kvflow.router.serving.admission import AdmissionConfig, TenantLoad, Verdict, decide
from kvflow.router.workers.book import LOAD_INTERVAL_S, LoadReport, WorkerBook, WorkerFacts

__all__ = ["LOAD_INTERVAL_S", "RouterSide"]

# The virtual cluster's traffic has no tenants: never over a share.
_ONE_TENANT = TenantLoad(0, 1.0, 0, 1.0, 1)


class RouterSide:
    def __init__(self, model: str, workers: Iterable[tuple[WorkerId, Role]]) -> None:
        self.model = model
        self.index = BlockIndex()
        self.sessions = SessionTable()
        self.book = WorkerBook()
        for worker_id, role in workers:
            self.add(worker_id, role)

    def add(self, worker_id: WorkerId, role: Role) -> None:
        """A worker that serves from now on (healthy: a simulated worker never fails)."""
        self.book.add(worker_id, WorkerFacts(self.model, role, caches_prefixes=True),
                      is_healthy=True)  # fmt: skip

    def poll(self, worker_id: WorkerId, load: LoadReport, at_s: float) -> None:
        """A Load answer (WorkerPool._monitor): no wait between asking and answering."""
        self.book.apply_report(worker_id, load, at_s)

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
        """A new request was sent there (WorkerPool.request_open): counted in its queue
        depth until `close`, and by admission until the worker's next report."""
        self.book.open(worker_id)

    def admit(self, config: AdmissionConfig) -> Verdict:
        """AdmissionControl.check over the routable workers: one tenant, so only the
        cluster-wide bounds (503) apply, never the over-share 429."""
        found = self.book.queues(self.model, 0.0)
        return decide(found.queues, found.num_opened_since_report, _ONE_TENANT, config)

    def close(self, worker_id: WorkerId) -> None:
        self.book.close(worker_id)

    def views(self) -> list[WorkerView]:
        """WorkerPool.views: every worker healthy, serving ``model`` (no busy holds: the
        simulated workers' queues are unbounded, so the clock passed is any)."""
        return self.book.views(0.0)
