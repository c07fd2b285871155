"""The set of workers this router knows, each probed for health and load, each followed
for KV events. What the probes learn goes into the pool's WorkerBook (workers/book.py):
`views()` is the snapshot routing reads, `book` what admission control reads. One Load
call per worker per interval serves both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import grpc

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.roles import Role
from kvflow.router.breaker.machine import Breaker, BreakerConfig, CircuitState, Outcome, Ticket
from kvflow.router.breaker.pool import PoolRefusal, pool_refusal, pool_state
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId, WorkerView
from kvflow.router.workers.book import LOAD_INTERVAL_S, WorkerBook, WorkerFacts
from kvflow.router.workers.client import WorkerClient
from kvflow.router.workers.convert import from_load_response
from kvflow.router.workers.errors import breaker_outcome
from kvflow.router.workers.kv_events import KvEventFollower
from kvflow.router.workers.tls import WorkerTls

log = logging.getLogger("kvflow.router.workers")

# Load every 250 ms (book.LOAD_INTERVAL_S): 16 workers cost 64 small calls a second, and
# between polls this router's own in-flight count keeps the estimate current.
HEALTH_EVERY_N_LOADS = 4
# A worker that failed is probed again this often, so a restarted one returns quickly.
UNHEALTHY_RETRY_S = 0.5
# Generous: a probe that times out marks the worker unhealthy, and a busy 2-core machine
# can stall an event loop for a second.
PROBE_TIMEOUT_S = 3.0


# A worker that refused with its queue full is not routed to for this long when it names
# no pushback of its own (a real engine's load report catches up within its poll interval),
# and never for longer than MAX_BUSY_HOLD_S.
BUSY_HOLD_S = 1.0
MAX_BUSY_HOLD_S = 10.0


# A circuit changed state: (scope "worker" or "pool", the worker or None, from, to).
CircuitHook = Callable[[str, WorkerId | None, CircuitState, CircuitState], None]


@dataclass
class Attempt:
    """One request on one worker (`WorkerPool.request_open`): its verdict for the worker's
    circuit breaker, when the caller knows it better than the exception that ends it."""

    outcome: Outcome | None = None


@dataclass
class _Worker:
    """The I/O side of a worker: its client, its tasks. Its state as routing and admission
    read it (its circuit breaker's too) is in the pool's WorkerBook."""

    worker_id: WorkerId
    client: WorkerClient
    info: pb.WorkerInfo | None = None  # its last Health's (model_info hands it out)
    is_healthy: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    follower: asyncio.Task[None] | None = None


def _facts(info: pb.WorkerInfo) -> WorkerFacts:
    return WorkerFacts(info.model, Role.from_pb(info.role), info.prefix_caching)


class WorkerPool:
    def __init__(
        self,
        index: BlockIndex,
        sessions: SessionTable,
        tls: WorkerTls | None = None,
        *,
        load_interval_s: float = LOAD_INTERVAL_S,
        name: str = "default",
        breaker: BreakerConfig | None = None,
        on_circuit: CircuitHook | None = None,
    ) -> None:
        """``load_interval_s``: how often each healthy worker is asked for its load;
        ``name``: the pool's, for logs and errors; ``breaker``: the circuit breakers'
        settings (default: BreakerConfig's), each worker's and the pool's own;
        ``on_circuit``: told of every change of their states."""
        self._index = index
        self._sessions = sessions
        self._tls = tls  # worker gRPC over TLS (workers/tls.py); None: plaintext
        self.load_interval_s = load_interval_s
        self.name = name
        self._workers: dict[WorkerId, _Worker] = {}
        self._on_circuit = on_circuit
        breaker = breaker or BreakerConfig()
        # Busy holds and circuits are on time.monotonic(), as are the reports' times.
        self.book = WorkerBook(breaker, partial(self._circuit_changed, "worker"))
        # The pool's own circuit: its requests' verdicts after failover (`choice_started`).
        self._breaker = Breaker(breaker, partial(self._circuit_changed, "pool", None))

    # -- membership ------------------------------------------------------------------------

    async def set_addresses(self, addresses: Iterable[str]) -> None:
        """Make the pool exactly these "host:port" workers (discovery calls this)."""
        wanted = {WorkerId(a) for a in addresses}
        for worker_id in set(self._workers) - wanted:
            await self._remove(worker_id)
        for worker_id in sorted(wanted - set(self._workers)):
            worker = _Worker(worker_id, WorkerClient(worker_id, self._tls))
            self._workers[worker_id] = worker
            self.book.add(worker_id)
            worker.tasks.append(asyncio.create_task(self._monitor(worker)))
            log.info("worker %s added", worker_id)

    async def _remove(self, worker_id: WorkerId) -> None:
        worker = self._workers.pop(worker_id)
        self.book.remove(worker_id)
        await self._cancel(worker)
        self._index.drop_worker(worker_id)
        self._sessions.forget_worker(worker_id)
        # Cancels its calls in flight: their requests see the worker as down (WorkerStream:
        # a call cancelled beneath its reader) and fail over, or end with an error event.
        await worker.client.close()
        log.info("worker %s removed", worker_id)

    async def _cancel(self, worker: _Worker) -> None:
        tasks = [*worker.tasks, *([worker.follower] if worker.follower else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        for worker_id in list(self._workers):
            await self._remove(worker_id)

    # -- probes ----------------------------------------------------------------------------

    def _restart_follower(self, worker: _Worker) -> None:
        """Follow the KV events from a fresh snapshot (also after any doubt about them)."""
        if worker.follower is not None:
            worker.follower.cancel()
        follower = KvEventFollower(worker.worker_id, worker.client, self._index)
        worker.follower = asyncio.create_task(follower.run())

    def _mark_unhealthy(self, worker: _Worker, why: str) -> None:
        if worker.is_healthy:
            log.warning("worker %s is unhealthy: %s", worker.worker_id, why)
        worker.is_healthy = False
        if worker.worker_id in self.book:
            self.book.set_healthy(worker.worker_id, False)
        # Its cache may be gone (a crash) or stale: forget it until a new snapshot says.
        self._index.clear(worker.worker_id)
        if worker.follower is not None:
            worker.follower.cancel()
            worker.follower = None

    async def _probe_health(self, worker: _Worker) -> None:
        health = await worker.client.health(PROBE_TIMEOUT_S)
        if not health.is_serving:
            self._mark_unhealthy(worker, "draining")
            return
        restarted = worker.info is not None and (worker.info.instance_id != health.info.instance_id)
        worker.info = health.info
        self.book.set_facts(worker.worker_id, _facts(health.info))
        if restarted:
            log.info("worker %s restarted (new instance)", worker.worker_id)
        if not worker.is_healthy or restarted or worker.follower is None:
            if not worker.is_healthy:
                log.info("worker %s is healthy (model %s)", worker.worker_id, health.info.model)
            worker.is_healthy = True
            self.book.set_healthy(worker.worker_id, True)
            self._restart_follower(worker)

    async def _monitor(self, worker: _Worker) -> None:
        num_loads = 0
        while True:
            try:
                if not worker.is_healthy or num_loads % HEALTH_EVERY_N_LOADS == 0:
                    await self._probe_health(worker)
                if worker.is_healthy and worker.info is not None:
                    asked = self.book.local_counts(worker.worker_id)
                    asked_s = time.monotonic()
                    load = await worker.client.load(PROBE_TIMEOUT_S)
                    report = from_load_response(load, worker.info.block_size)
                    self.book.apply_report(worker.worker_id, report, asked_s, asked)
                    num_loads += 1
            except grpc.aio.AioRpcError as exc:
                self._mark_unhealthy(worker, f"{exc.code().name}: {exc.details()}")
            except Exception:
                # A bug must not silently end the probes of this worker forever.
                log.exception("probing %s failed", worker.worker_id)
                self._mark_unhealthy(worker, "probe error")
            await asyncio.sleep(self.load_interval_s if worker.is_healthy else UNHEALTHY_RETRY_S)

    # -- what routing and serving read -------------------------------------------------------

    def views(self) -> list[WorkerView]:
        return self.book.views(time.monotonic())

    def client(self, worker_id: WorkerId) -> WorkerClient:
        return self._workers[worker_id].client

    def model_info(self, model: str) -> pb.WorkerInfo | None:
        """The facts of a healthy worker serving ``model`` (hash seed, block size, limits)."""
        for w in self._workers.values():
            if w.is_healthy and w.info is not None and w.info.model == model:
                return w.info
        return None

    def info_of(self, worker_id: WorkerId) -> pb.WorkerInfo | None:
        """A worker's facts from its last Health (its task, an embedder's dimensions)."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.info

    def known_models(self) -> set[str]:
        return {w.info.model for w in self._workers.values() if w.info is not None}

    def num_healthy(self) -> int:
        return sum(w.is_healthy for w in self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def mark_failed(self, worker_id: WorkerId, why: str) -> None:
        """A request failed there before its first token: stop routing to it at once."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._mark_unhealthy(worker, why)

    def refused_busy(self, worker_id: WorkerId, retry_after_s: float | None) -> None:
        """The worker refused a request, its queue full: route elsewhere for its pushback
        (BUSY_HOLD_S without one), whatever its last load report said. Still probed and
        counted healthy: it is up, only full."""
        hold_s = BUSY_HOLD_S if retry_after_s is None else min(retry_after_s, MAX_BUSY_HOLD_S)
        self.book.hold_busy(worker_id, time.monotonic() + hold_s)

    @contextlib.contextmanager
    def request_open(self, worker_id: WorkerId) -> Iterator[Attempt]:
        """Count a request as in flight on a worker while the block runs, and give the
        worker's circuit breaker its verdict when it ends: the Attempt's outcome if the
        block set one, else success, or what the exception ending it says of the worker
        (workers/errors.breaker_outcome)."""
        self.book.open(worker_id)
        breaker = self.book.breaker(worker_id)
        ticket = breaker.start(time.monotonic()) if breaker is not None else None
        attempt = Attempt()
        try:
            yield attempt
            attempt.outcome = attempt.outcome or Outcome.SUCCESS
        except BaseException as exc:
            attempt.outcome = attempt.outcome or breaker_outcome(exc)
            raise
        finally:
            self.book.close(worker_id)
            if breaker is not None and ticket is not None:
                _judge(breaker, ticket, attempt.outcome)

    # -- circuit breakers (kvflow.router.breaker) ----------------------------------------------

    def circuit_refusal(self) -> PoolRefusal | None:
        """Whether the pool's circuit refuses a request now (its own breaker is open, or
        every healthy worker's is), and when to come back."""
        return pool_refusal(self._breaker, self.book.healthy_breakers(), time.monotonic())

    def circuit_state(self) -> CircuitState:
        """The pool's circuit, for its gauge (reads only: safe from a scrape's thread)."""
        return pool_state(self._breaker, self.book.healthy_breakers(), time.monotonic())

    def worker_circuits(self) -> dict[WorkerId, CircuitState]:
        """Each worker's circuit, for its gauge (reads only)."""
        return self.book.circuits(time.monotonic())

    def choice_started(self) -> Ticket:
        """One choice of a request starts on this pool (`choice_ended` gives its verdict)."""
        return self._breaker.start(time.monotonic())

    def choice_ended(self, ticket: Ticket, outcome: Outcome | None) -> None:
        """The verdict of a choice after failover: one worker failing and the next serving
        it is a success of the pool (that worker's own circuit counted the failure). A
        stall counts as a timeout here: one wedged worker trips its own circuit at once,
        and must not shut the whole pool for it."""
        if outcome is Outcome.STALL:
            outcome = Outcome.TIMEOUT
        _judge(self._breaker, ticket, outcome)

    def _circuit_changed(
        self, scope: str, worker_id: WorkerId | None, was: CircuitState, to: CircuitState
    ) -> None:
        what = f"worker {worker_id}" if worker_id is not None else f"pool {self.name}"
        if to is CircuitState.OPEN:
            breaker = self._breaker if worker_id is None else self.book.breaker(worker_id)
            why = breaker.last_trip if breaker is not None else ""
            log.warning("%s: circuit %s -> open: %s", what, was.label, why)
        else:
            log.info("%s: circuit %s -> %s", what, was.label, to.label)
        if self._on_circuit is not None:
            self._on_circuit(scope, worker_id, was, to)


def _judge(breaker: Breaker, ticket: Ticket, outcome: Outcome | None) -> None:
    now_s = time.monotonic()
    if outcome is None:
        breaker.abandon(ticket, now_s)
    else:
        breaker.finish(ticket, outcome, now_s)
