"""A virtual cluster whose workers come and go: the planner benchmark's Deployment.

`VirtualCluster` (cluster.py) has a fixed set of workers. Scaling a role is three things a
Deployment and its pods do, and this subclass does them on the event clock:

- **scale up**: a pod is created at once (it holds its GPU from then on: replica-hours
  count it) and serves after `startup_s` (image pull, weight load); only then does the
  router see it;
- **scale down**: the newest replica (a starting one first, as a ReplicaSet deletes
  not-ready pods first) leaves the router's views at once and drains: it finishes what it
  holds, then disappears;
- the **observations** a metrics scrape would give: arrivals, the times of the requests
  admission control refused, first tokens with their TTFT and the queue wait the engine
  measured (`Timings.queued_s`), the requests that ended, and each worker's running
  requests and KV usage as its Load RPC answers. Like the workers' and routers' metrics
  as the operator's planner reads them, these logs count the online classes only
  (`_is_online`): a batch request is neither demand nor a latency to scale for.

It touches one thing of its base classes that they do not publish: `VirtualCluster._poll`
(a removed worker stops polling).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.core.kv_events import KvEvent
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest
from kvflow.proto.roles import Role
from kvflow.router.routing.types import WorkerId, WorkerView
from kvflow.router.serving.admission import Verdict
from kvflow.sim.arms import Arm
from kvflow.sim.cluster import ClusterSpec, VirtualCluster, _InFlight
from kvflow.sim.router_side import RouterSide
from kvflow.sim.worker import SimWorker


class ElasticRouterSide(RouterSide):
    """The router's views of a changing pool: workers join when ready, leave when drained."""

    def __init__(self, base: RouterSide) -> None:  # adopt: the placement holds base's index
        self.model = base.model
        self.index = base.index
        self.sessions = base.sessions
        self.book = base.book
        self._hidden: set[WorkerId] = set()

    def num_open(self, worker_id: WorkerId) -> int:
        """Requests this router opened there and has not closed (their end not yet seen)."""
        return self.book.local_counts(worker_id).num_open

    def hide(self, worker_id: WorkerId) -> None:
        """Out of the endpoints (draining): no new request goes there, and admission no
        longer counts its queue."""
        self._hidden.add(worker_id)
        self.book.set_healthy(worker_id, False)

    def drop(self, worker_id: WorkerId) -> None:
        self._hidden.discard(worker_id)
        self.book.remove(worker_id)
        self.index.clear(worker_id)

    def views(self) -> list[WorkerView]:
        return [v for v in super().views() if v.worker_id not in self._hidden]


@dataclass(frozen=True)
class Finished:
    """One ended request, as the metrics see it."""

    end_s: float
    record: RequestRecord
    queued_s: float | None


class ElasticCluster(VirtualCluster):
    """Colocated workers only: the benchmark scales one role."""

    def __init__(self, spec: ClusterSpec, arm: Arm, *, startup_s: float, seed: int = 0) -> None:
        if spec.num_prefill_workers:
            raise ValueError("the elastic cluster scales colocated workers only")
        super().__init__(spec, arm, seed=seed)
        self.startup_s = startup_s
        self._elastic = ElasticRouterSide(self.router)
        self.router = self._elastic
        self._num_created = len(self.workers)
        self._starting: list[WorkerId] = []  # ordered, ready at their time
        self._draining: set[WorkerId] = set()
        self._cancelled: set[WorkerId] = set()
        self.finished: list[Finished] = []
        self.arrivals: list[tuple[float, int]] = []  # (time, prompt tokens)
        self.refusals: list[float] = []  # times admission control answered 429/503
        self.first_tokens: list[tuple[float, float]] = []  # (time, TTFT)
        # (time of the first token, seconds queued before the first step): the engine's
        # Timings.queued_s, taken when the request starts streaming, not when it ends.
        self.queue_waits: list[tuple[float, float]] = []
        self.num_scale_events = 0
        # True: the logs count batch requests like online ones, as the planner read them
        # before the metrics carried a class (a comparison arm of the batch day).
        self.counts_batch = False

    # -- replicas --------------------------------------------------------------------------

    @property
    def num_ready(self) -> int:
        return len(self.workers) - len(self._draining)

    @property
    def num_starting(self) -> int:
        return len(self._starting)

    @property
    def num_desired(self) -> int:
        return self.num_ready + self.num_starting

    @property
    def num_holding_gpus(self) -> int:
        """Pods that hold a GPU: starting, serving and draining."""
        return len(self.workers) + len(self._starting)

    def ready_workers(self) -> list[SimWorker]:
        return [w for wid, w in self.workers.items() if wid not in self._draining]

    def scale_to(self, replicas: int) -> None:
        current = self.num_desired
        if replicas != current:
            self.num_scale_events += 1
        for _ in range(replicas - current):
            worker_id = WorkerId(f"sim-{self._num_created}")
            self._num_created += 1
            self._starting.append(worker_id)
            self.events.after(self.startup_s, partial(self._ready, worker_id))
        for _ in range(current - replicas):
            if self._starting:  # a pod that is not ready goes first
                self._cancelled.add(self._starting.pop())
            else:
                self._drain(self._newest_serving())

    def _newest_serving(self) -> WorkerId:
        serving = [w for w in self.workers if w not in self._draining]
        assert serving, "scale_to never drains the last serving worker below zero"
        return max(serving, key=lambda w: int(w.split("-")[1]))

    def _ready(self, worker_id: WorkerId) -> None:
        if worker_id in self._cancelled:
            self._cancelled.discard(worker_id)
            return
        self._starting.remove(worker_id)
        self.workers[worker_id] = SimWorker(
            worker_id,
            self._config,
            self.spec.profile.timing,
            self.events,
            self._on_step_done,
            kv_bytes_per_block=self.spec.profile.kv_bytes_per_block,
        )
        self._elastic.add(worker_id, Role.COLOCATED)
        if self._is_polling:
            self.events.at(self.events.now_s, partial(self._poll, worker_id))

    def _drain(self, worker_id: WorkerId) -> None:
        self._draining.add(worker_id)
        self._elastic.hide(worker_id)
        self._drop_if_drained(worker_id)

    def _drop_if_drained(self, worker_id: WorkerId) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or worker_id not in self._draining:
            return
        # Not the engine's queues: a request finished in a step leaves them when the step is
        # computed, but its last tokens reach the client only when the step ends.
        if self._elastic.num_open(worker_id):
            return
        del self.workers[worker_id]
        self._draining.discard(worker_id)
        self._elastic.drop(worker_id)

    def _poll(self, worker_id: WorkerId) -> None:
        if worker_id in self.workers:
            super()._poll(worker_id)

    # -- what the metrics see: arrivals, first tokens, ends with the engine's queue time ----

    def _is_online(self, request: BenchRequest) -> bool:
        """Whether the planner's metrics count it (kvflow.proto.priority_class)."""
        return self.counts_batch or self._tenant_and_class(request)[1].is_online

    def _arrive(self, request: BenchRequest) -> None:
        if self._is_online(request):
            self.arrivals.append((self.events.now_s, request.num_prompt_words))
        super()._arrive(request)

    def _refuse(self, request: BenchRequest, now_s: float, verdict: Verdict) -> None:
        if self._is_online(request):
            self.refusals.append(now_s)
        super()._refuse(request, now_s, verdict)

    def _on_step_done(
        self, worker: SimWorker, outputs: list[RequestOutput], kv_events: list[KvEvent]
    ) -> None:
        fresh = []
        for out in outputs:
            flight = self._inflight.get(out.request_id)
            request = worker.engine.requests.get(out.request_id)
            if (
                flight is not None
                and not flight.token_times_s
                and request is not None
                and self._is_online(flight.request)
            ):
                start_s = request.first_scheduled_time_s
                queued_s = None if start_s is None else start_s - request.arrival_time_s
                fresh.append((flight, queued_s))
        super()._on_step_done(worker, outputs, kv_events)
        now_s = self.events.now_s
        for flight, queued_s in fresh:
            if flight.token_times_s:
                self.first_tokens.append((now_s, flight.token_times_s[0] - flight.arrival_s))
                if queued_s is not None:
                    self.queue_waits.append((now_s, queued_s))

    def _finish(self, flight: _InFlight, out: RequestOutput, now_s: float) -> None:
        super()._finish(flight, out, now_s)
        queued_s = out.timings.queued_s if out.timings is not None else None
        if self._is_online(flight.request):
            self.finished.append(Finished(now_s, self.records[-1], queued_s))
        self._drop_if_drained(WorkerId(flight.worker.worker_id))
