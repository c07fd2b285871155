"""Gateway admission control, the I/O shell: read the workers' queues, count this router's
requests in flight per tenant, and refuse with 429 or 503 before generating
(serving/admission.py decides; this module only gathers what it needs and says no).

The queues are read with the workers' Load call every ``poll_interval_s``; the pool reads
Load too, for routing, but keeps only a queue depth, and the estimate needs the waiting
count, the queue's bound and its drain rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.proto.fairness import priority_weight
from kvflow.proto.roles import Role
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import no_worker_available, rate_limited
from kvflow.router.protocol.responses import ChoiceDelta
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import (
    AdmissionConfig,
    TenantLoad,
    Verdict,
    WorkerQueue,
    decide,
)
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.types import Caller, ChoiceSpec, ChoiceUsage, RequestTrace
from kvflow.router.tenants.config import Tenant
from kvflow.router.workers.errors import GRPC_CALL_ERRORS
from kvflow.router.workers.pool import WorkerPool

log = logging.getLogger("kvflow.router.admission")

# A Load is a few bytes; a worker that takes longer than this is busy enough that its last
# report (or none) is as good.
LOAD_TIMEOUT_S = 1.0


@dataclass
class _Polled:
    model: str
    queue: WorkerQueue


class AdmissionControl:
    def __init__(
        self, pool: WorkerPool, config: AdmissionConfig, metrics: RouterMetrics, pool_name: str
    ) -> None:
        """``pool_name`` labels the pool's refusals (``kvflow_router_admission_rejections``)."""
        self._pool = pool
        self.config = config
        self._metrics = metrics
        self.pool_name = pool_name
        metrics.admission_pool(pool_name)
        self._queues: dict[WorkerId, _Polled] = {}
        self._num_dispatched = 0  # admitted since the queues were last read
        self._in_flight: Counter[str] = Counter()
        self._weights: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.is_enabled:
            self._task = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.poll_interval_s)

    async def poll_once(self) -> None:
        """Read every healthy worker's queue; forget the others'."""
        views = [v for v in self._pool.views() if v.is_healthy]
        dispatched_before = self._num_dispatched
        results = await asyncio.gather(*(self._read(v.worker_id) for v in views))
        self._queues = {
            v.worker_id: _Polled(v.model, queue)
            for v, queue in zip(views, results, strict=True)
            if queue is not None
        }
        # What was admitted while the reads were out may not show in them yet: keep it.
        self._num_dispatched -= dispatched_before

    async def _read(self, worker_id: WorkerId) -> WorkerQueue | None:
        try:
            load = await self._pool.client(worker_id).load(LOAD_TIMEOUT_S)
        except KeyError:  # left the pool since views()
            return None
        except GRPC_CALL_ERRORS as exc:
            log.debug("reading the queue of %s failed: %s", worker_id, exc)
            return None
        return WorkerQueue(worker_id, load.num_waiting, load.max_waiting_requests,
                           load.queue_drain_rate_per_s)  # fmt: skip

    def eligible_queues(self, model: str) -> list[WorkerQueue]:
        """The last read queues of the healthy workers that can stream ``model``."""
        queues = []
        for view in self._pool.views():
            polled = self._queues.get(view.worker_id)
            if (
                polled is not None
                and view.is_healthy
                and view.model == model
                and view.role is not Role.PREFILL
            ):
                queues.append(polled.queue)
        return queues

    def tenant_load(self, tenant: Tenant) -> TenantLoad:
        weight = priority_weight(tenant.priority)
        active = {name for name, n in self._in_flight.items() if n > 0} | {tenant.name}
        weights = {**self._weights, tenant.name: weight}
        return TenantLoad(
            num_in_flight=self._in_flight[tenant.name],
            weight=weight,
            num_in_flight_total=sum(self._in_flight.values()),
            active_weight_total=sum(weights[name] for name in active),
            num_active_tenants=len(active),
        )

    def check(self, tenant: Tenant, model: str) -> Verdict:
        """Admit (counted as dispatched), or raise the ApiError: 429 or 503 + Retry-After."""
        verdict = decide(self.eligible_queues(model), self._num_dispatched,
                         self.tenant_load(tenant), self.config)  # fmt: skip
        if verdict.is_admitted:
            self._num_dispatched += 1
            return verdict
        self._metrics.tenant_rejections.labels(tenant.name, verdict.reason).inc()
        rejections = self._metrics.admission_rejections
        rejections.labels(str(verdict.status), verdict.reason, self.pool_name).inc()
        wait = f"about {verdict.estimated_wait_s:.0f} s of queue"
        if verdict.status == 429:
            raise rate_limited(
                f"The cluster is busy ({wait}) and tenant '{tenant.name}' has more than its "
                f"share of the requests in flight; retry after {verdict.retry_after_s:.0f} s.",
                retry_after_s=verdict.retry_after_s,
                kind="requests",
            )
        why = "every worker's queue is full" if verdict.reason == "queues_full" else wait
        raise no_worker_available(
            f"The cluster is at capacity for '{model}' ({why}); "
            f"retry after {verdict.retry_after_s:.0f} s.",
            retry_after_s=verdict.retry_after_s,
        )

    @contextlib.contextmanager
    def in_flight(self, tenant: Tenant) -> Iterator[None]:
        """Count one of the tenant's requests as in flight at this router meanwhile."""
        self._in_flight[tenant.name] += 1
        self._weights[tenant.name] = priority_weight(tenant.priority)
        try:
            yield
        finally:
            self._in_flight[tenant.name] -= 1
            if self._in_flight[tenant.name] <= 0:
                del self._in_flight[tenant.name]
                self._weights.pop(tenant.name, None)


class AdmittedGenerationService(GenerationService):
    """GenerationService behind admission control: `run` refuses (429/503) before any
    choice starts, and counts the request in flight for its tenant until it ends."""

    def __init__(self, admission: AdmissionControl, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admission = admission

    async def run(
        self, caller: Caller, specs: Sequence[ChoiceSpec], trace: RequestTrace, *, buffered: bool
    ) -> AsyncGenerator[ChoiceDelta | ChoiceUsage]:
        # Admitted already (api/completions.py, before preparing its prompts): checked and
        # counted in flight by its caller, until it ends.
        with contextlib.ExitStack() as in_flight:
            if not trace.is_admitted:
                self.admission.check(caller.tenant, caller.model)
                in_flight.enter_context(self.admission.in_flight(caller.tenant))
            stream = super().run(caller, specs, trace, buffered=buffered)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    yield item
