"""Gateway admission control, the shell: read the workers' queues, count this router's
requests in flight per tenant, and refuse with 429 or 503 before generating
(serving/admission.py decides; this module only gathers what it needs and says no).

The queues are the worker pool's: its one Load poll per worker (workers/pool.py) records
each report in its WorkerBook (workers/book.py), waiting count, bound and drain rate
included; admission reads them at each check and asks the workers nothing itself. What
it admitted after the oldest of those reports was asked for cannot show in them, so it
counts those admissions in (a burst is counted as it is admitted, before any reaches a
worker). ``poll_interval_s`` bounds how old a report may be: the pool polls at the
shorter of it and its own interval (api/backend.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

from kvflow.proto.fairness import priority_weight
from kvflow.proto.priority_class import PriorityClass
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import no_worker_available, rate_limited
from kvflow.router.protocol.responses import ChoiceDelta
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
from kvflow.router.workers.pool import WorkerPool


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
        self._in_flight: Counter[str] = Counter()
        self._weights: dict[str, float] = {}
        self._admitted_s: deque[float] = deque()  # when (monotonic), not yet in every report

    def eligible_queues(self, model: str) -> tuple[list[WorkerQueue], int]:
        """The last reported queues of the healthy workers that can stream ``model``, and
        how many admissions may not show in them yet (admitted after the oldest report)."""
        found = self._pool.book.queues(model, time.monotonic())
        if found.oldest_report_s is None:
            self._admitted_s.clear()
            return found.queues, 0
        while self._admitted_s and self._admitted_s[0] < found.oldest_report_s:
            self._admitted_s.popleft()
        return found.queues, len(self._admitted_s)

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

    def check(
        self, tenant: Tenant, model: str, priority_class: PriorityClass = PriorityClass.NORMAL
    ) -> Verdict:
        """Admit (counted until the reports can show it), or raise the ApiError: 429 or
        503 + Retry-After. ``priority_class`` moves the thresholds (batch is shed first)."""
        queues, num_unseen = self.eligible_queues(model)
        if not queues and not self._pool.num_healthy():
            # Counted as a refusal: the demand the planner sees for a pool with no worker
            # (scaled to zero), and brings one back for (docs/planner.md).
            self._metrics.admission_rejections.labels(
                "503", "no_worker", self.pool_name, priority_class.value
            ).inc()
            raise no_worker_available(
                f"No worker of '{model}' is up ({len(self._pool)} known, none healthy); one "
                "is on its way if the pool scales on demand: retry shortly."
            )
        load = self.tenant_load(tenant)
        verdict = decide(queues, num_unseen, load, self.config, priority_class)
        if verdict.is_admitted:
            self._admitted_s.append(time.monotonic())
            return verdict
        self._metrics.tenant_rejections.labels(tenant.name, verdict.reason).inc()
        rejections = self._metrics.admission_rejections
        status = str(verdict.status)
        rejections.labels(status, verdict.reason, self.pool_name, priority_class.value).inc()
        self._metrics.class_rejections.labels(priority_class.value, verdict.reason).inc()
        wait = f"about {verdict.estimated_wait_s:.0f} s of queue"
        if verdict.status == 429:
            raise rate_limited(
                f"The cluster is busy ({wait}) and tenant '{tenant.name}' has more than its "
                f"share of the requests in flight; retry after {verdict.retry_after_s:.0f} s.",
                retry_after_s=verdict.retry_after_s,
                kind="requests",
            )
        if verdict.reason == "batch_shed":
            raise no_worker_available(
                f"The cluster is busy for '{model}' ({wait}): batch requests are shed first; "
                f"retry after {verdict.retry_after_s:.0f} s.",
                retry_after_s=verdict.retry_after_s,
            )
        why = "every worker's queue is full" if verdict.reason == "queues_full" else wait
        raise no_worker_available(
            f"The cluster is at capacity for '{model}' ({why}); "
            f"retry after {verdict.retry_after_s:.0f} s.",
            retry_after_s=verdict.retry_after_s,
        )

    def peek(
        self, tenant: Tenant, model: str, priority_class: PriorityClass = PriorityClass.NORMAL
    ) -> Verdict:
        """What `check` would answer now, counting and raising nothing: for a request that
        waits for capacity (degrade/service.py, queue_with_deadline) and asks again."""
        queues, num_unseen = self.eligible_queues(model)
        return decide(queues, num_unseen, self.tenant_load(tenant), self.config, priority_class)

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
                self.admission.check(caller.tenant, caller.model, caller.priority_class)
                in_flight.enter_context(self.admission.in_flight(caller.tenant))
            stream = super().run(caller, specs, trace, buffered=buffered)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    yield item
