"""The router's record of its workers, pure: what each is, whether it is up, its last load
report, and this router's requests in flight there. Routing reads `views()`, admission
control reads `queues()`.

One book, fed by one poller: the gateway's WorkerPool (workers/pool.py) applies each Load
answer it gets, on time.monotonic(); the simulator's router side (kvflow.sim.router_side)
applies its workers' reports on its virtual clock. Neither keeps worker state of its own,
so both route and admit from the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.proto.roles import Role
from kvflow.router.breaker.machine import Breaker, BreakerConfig, CircuitState
from kvflow.router.routing.types import WorkerId, WorkerView
from kvflow.router.serving.admission import WorkerQueue

# How often each worker is asked for its load (the pool, every HEALTH_EVERY_N_LOADS-th time
# its health too; the simulator, on its clock): a quarter second keeps routing within a few
# requests of the truth, and between reports this router's own requests correct it.
LOAD_INTERVAL_S = 0.25


def estimate_queue_depth(num_reported: int, num_local_now: int, num_local_at_report: int) -> int:
    """Requests queued or running on a worker: its last report, corrected by what this
    router has started or finished there since (reports are up to LOAD_INTERVAL_S old)."""
    return max(0, num_reported + num_local_now - num_local_at_report)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's Load answer as the router reads it (workers/convert.py makes it from the
    wire's LoadResponse; the simulator's workers make it directly). Tokens, not blocks."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of the worker's KV blocks held by requests, 0..1
    max_waiting_requests: int = 0  # the queue's bound; 0: unbounded
    queue_drain_rate_per_s: float = 0.0  # admissions per second while backlogged; 0: unknown
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    num_kv_tokens: int = 0
    kv_capacity_tokens: int = 0  # 0: unknown
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerFacts:
    """What a worker is (its Health's WorkerInfo, the part routing reads)."""

    model: str
    role: Role
    caches_prefixes: bool  # publishes KV events for the prompts it keeps


@dataclass(frozen=True, slots=True)
class LocalCounts:
    """This router's requests at a worker at one moment: open now, and opened ever."""

    num_open: int
    num_opened: int


@dataclass(frozen=True, slots=True)
class Queues:
    """The eligible workers' waiting queues as last reported, and what they cannot show."""

    queues: list[WorkerQueue]
    num_opened_since_report: int  # requests this router opened there since the reports
    oldest_report_s: float | None  # when the oldest of those reports was asked for


@dataclass
class _Entry:
    facts: WorkerFacts | None = None
    is_healthy: bool = False
    busy_until_s: float = 0.0  # refused with a full queue: not routed to before this
    report: LoadReport | None = None
    reported_at_s: float | None = None  # on the feeder's clock
    num_open: int = 0  # this router's requests there, now
    num_opened: int = 0  # ever: the difference to the report's is what it cannot show yet
    at_report: LocalCounts = LocalCounts(0, 0)
    # Its circuit breaker (kvflow.router.breaker): fed by whoever sends it requests.
    breaker: Breaker = field(default_factory=lambda: Breaker(BreakerConfig(is_enabled=False)))


# A worker's circuit changed state: (worker, from, to), for the transitions counter and log.
WorkerTransitionHook = Callable[[WorkerId, CircuitState, CircuitState], None]


class WorkerBook:
    def __init__(
        self,
        breaker: BreakerConfig | None = None,
        on_transition: WorkerTransitionHook | None = None,
    ) -> None:
        """``breaker``: the settings of each worker's circuit breaker; None: none (always
        closed, as in the simulator, which does not feed them)."""
        self._entries: dict[WorkerId, _Entry] = {}
        self._breaker = breaker or BreakerConfig(is_enabled=False)
        self._on_transition = on_transition

    def _new_breaker(self, worker_id: WorkerId) -> Breaker:
        hook = self._on_transition
        if hook is None:
            return Breaker(self._breaker)
        return Breaker(self._breaker, lambda was, to: hook(worker_id, was, to))

    # -- membership and health ---------------------------------------------------------------

    def add(self, worker_id: WorkerId, facts: WorkerFacts | None = None, *,
            is_healthy: bool = False) -> None:  # fmt: skip
        self._entries[worker_id] = _Entry(facts, is_healthy, breaker=self._new_breaker(worker_id))

    def remove(self, worker_id: WorkerId) -> None:
        self._entries.pop(worker_id, None)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._entries

    def set_facts(self, worker_id: WorkerId, facts: WorkerFacts) -> None:
        self._entries[worker_id].facts = facts

    def set_healthy(self, worker_id: WorkerId, is_healthy: bool) -> None:
        self._entries[worker_id].is_healthy = is_healthy

    def hold_busy(self, worker_id: WorkerId, until_s: float) -> None:
        """Healthy but refusing (its queue full): its last report may predate that."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.busy_until_s = until_s

    def breaker(self, worker_id: WorkerId) -> Breaker | None:
        """The worker's circuit breaker; None once it left."""
        entry = self._entries.get(worker_id)
        return entry.breaker if entry is not None else None

    def healthy_breakers(self) -> list[Breaker]:
        """The circuit breakers of the workers passing their health probes that stream
        tokens (a prefill worker alone serves no request). Over a copy of the entries: a
        metrics scrape calls this from its own thread."""
        entries = list(self._entries.values())
        return [
            e.breaker
            for e in entries
            if e.is_healthy and e.facts is not None and e.facts.role is not Role.PREFILL
        ]

    def circuits(self, now_s: float) -> dict[WorkerId, CircuitState]:
        """Each worker's circuit at ``now_s`` (reads only: safe from a metrics scrape)."""
        return {worker_id: e.breaker.state(now_s) for worker_id, e in list(self._entries.items())}

    # -- load ------------------------------------------------------------------------------

    def local_counts(self, worker_id: WorkerId) -> LocalCounts:
        entry = self._entries[worker_id]
        return LocalCounts(entry.num_open, entry.num_opened)

    def apply_report(self, worker_id: WorkerId, report: LoadReport, at_s: float,
                     asked: LocalCounts | None = None) -> None:  # fmt: skip
        """A load report taken at ``at_s``. ``asked``: this router's counts when it asked
        (`local_counts` before the call), since what it opened while the answer was on its
        way may not show in it; None: now (an answer with no wait, as in virtual time)."""
        entry = self._entries.get(worker_id)
        if entry is None:  # left while its answer was on the way
            return
        entry.report, entry.reported_at_s = report, at_s
        entry.at_report = asked or LocalCounts(entry.num_open, entry.num_opened)

    def open(self, worker_id: WorkerId) -> None:
        """This router sent a request there (counted until `close`)."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.num_open += 1
            entry.num_opened += 1

    def close(self, worker_id: WorkerId) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None and entry.num_open > 0:  # not a re-added worker's
            entry.num_open -= 1

    # -- what routing and admission read ------------------------------------------------------

    def _is_routable(self, entry: _Entry, now_s: float) -> bool:
        return entry.is_healthy and entry.busy_until_s <= now_s

    @staticmethod
    def _circuit(entry: _Entry, now_s: float) -> CircuitState:
        """As routing reads it: a half-open circuit whose probes are out takes nothing."""
        if not entry.breaker.admits(now_s):
            return CircuitState.OPEN
        return entry.breaker.state(now_s)

    def views(self, now_s: float) -> list[WorkerView]:
        """Every worker as routing sees it at ``now_s`` (the busy holds' clock)."""
        views = []
        for worker_id, e in self._entries.items():
            r = e.report or LoadReport()
            num_reported = r.num_waiting + r.num_running
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    model=e.facts.model if e.facts is not None else "",
                    role=e.facts.role if e.facts is not None else Role.COLOCATED,
                    is_healthy=self._is_routable(e, now_s),
                    queue_depth=estimate_queue_depth(
                        num_reported, e.num_open, e.at_report.num_open
                    ),
                    kv_usage=r.kv_usage,
                    caches_prefixes=e.facts is not None and e.facts.caches_prefixes,
                    num_prefill_tokens=r.num_prefill_tokens,
                    num_decode_seqs=r.num_decode_seqs,
                    num_kv_tokens=r.num_kv_tokens,
                    kv_capacity_tokens=r.kv_capacity_tokens,
                    num_cached_tokens=r.num_cached_tokens,
                    load_at_s=e.reported_at_s if e.report is not None else None,
                    circuit=self._circuit(e, now_s),
                )
            )
        return views

    def queues(self, model: str, now_s: float) -> Queues:
        """The waiting queues of the routable workers that can stream ``model``, as last
        reported, and the requests this router opened there since their reports."""
        queues: list[WorkerQueue] = []
        num_opened_since = 0
        oldest_s: float | None = None
        for worker_id, e in self._entries.items():
            r, facts = e.report, e.facts
            if (
                r is None
                or facts is None
                or not self._is_routable(e, now_s)
                or not e.breaker.admits(now_s)  # its queue is no capacity while open
                or facts.model != model
                or facts.role is Role.PREFILL
            ):
                continue
            queues.append(WorkerQueue(worker_id, r.num_waiting, r.max_waiting_requests,
                                      r.queue_drain_rate_per_s))  # fmt: skip
            num_opened_since += e.num_opened - e.at_report.num_opened
            if e.reported_at_s is not None:
                oldest_s = e.reported_at_s if oldest_s is None else min(oldest_s, e.reported_at_s)
        return Queues(queues, num_opened_since, oldest_s)
