"""The waiting queue: by priority class first, fair across tenants within a class, priority
then first come first served within a tenant.

A request's class (``Request.priority_class``: realtime, normal, batch) is a rank, not a
weight: every waiting realtime request is admitted before any normal one, and every normal
one before any batch one, whatever the tenants' shares. Each tenant's heap is ordered by
class first, so its head is its most urgent request, and the next admission goes to the
tenant whose head is of the most urgent class waiting; the fair share below breaks ties
among the tenants with a head of that class.

A single priority heap lets one tenant's burst starve everyone behind it: 500 requests of
tenant A queued at once put tenant B's next request 500 admissions back. Here each tenant
(``Request.tenant``: its cache salt on the wire, unique per tenant by default) has its own
heap, and the next admission goes to the backlogged tenant that has been served the fewest
tokens so far, weighted by priority: the Virtual Token Counter of Sheng et al., "Fairness
in Serving Large Language Models" (OSDI 2024). Every token a step computes for a request
(prefill chunk or decode) is charged to its tenant, divided by the priority's weight.

- A tenant that becomes backlogged starts level with the least-served backlogged tenant
  (or the last one admitted), not with the credit of the hour it was idle: otherwise a
  quiet tenant's burst would in turn starve the others until it caught up.
- Priority is a weight, not a rank: a tenant ``p`` levels more urgent than another gets
  ``PRIORITY_WEIGHT_BASE ** p`` (kvflow.proto.fairness) times its share while both wait,
  and the other is never starved (strict priority starved it for as long as the urgent
  tenant kept sending).
- Within one tenant and class the old order holds: lower priority value first, then
  arrival; a preempted request keeps its arrival time and so goes back to the head of its
  tenant and class.

Push, pop and peek are O(log n) in the tenant's requests plus O(t) in the number of
backlogged tenants (a min over a dict: t is tens, where a second heap keyed by a counter
that changes on every step would cost more than it saves).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvflow.engine_worker.core.request import Request
from kvflow.proto.fairness import priority_weight
from kvflow.proto.priority_class import PriorityClass

_Key = tuple[int, int, float, str]


def _key(request: Request) -> _Key:
    """The class's rank (0 most urgent), then the request's own order within its tenant."""
    return (request.priority_class.rank, *request.sort_key())


class FairWaitingQueue:
    """Waiting requests per tenant; ``peek``/``pop`` give the next one to admit."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[_Key, Request]]] = {}
        # Weighted tokens served per tenant, kept for tenants that went idle so that a
        # tenant cannot reset its count by pausing for a step.
        self._served: dict[str, float] = {}
        self._last_admitted_served = 0.0
        self._num_waiting = 0
        self._num_by_rank = [0] * len(PriorityClass)  # waiting requests per class, by rank

    def push(self, request: Request) -> None:
        tenant = request.tenant
        heap = self._heaps.get(tenant)
        if heap is None:
            floor = self._floor()
            self._prune(floor)
            self._served[tenant] = max(self._served.get(tenant, 0.0), floor)
            heap = self._heaps[tenant] = []
        heapq.heappush(heap, (_key(request), request))
        self._num_waiting += 1
        self._num_by_rank[request.priority_class.rank] += 1

    def _floor(self) -> float:
        """Where a newly backlogged tenant's count starts: level with the least served of
        the backlogged tenants, or with the last admitted one when none waits."""
        if not self._heaps:
            return self._last_admitted_served
        return min(self._served[t] for t in self._heaps)

    def _next_tenant(self) -> str:
        assert self._heaps, "peek or pop on an empty queue"
        # The most urgent class at any tenant's head first, then the least served tenant.
        return min(
            self._heaps,
            key=lambda t: (self._heaps[t][0][0][0], self._served[t], self._heaps[t][0][0]),
        )

    def peek(self) -> Request:
        return self._heaps[self._next_tenant()][0][1]

    def pop(self) -> Request:
        tenant = self._next_tenant()
        heap = self._heaps[tenant]
        request = heapq.heappop(heap)[1]
        if not heap:
            del self._heaps[tenant]
        self._last_admitted_served = self._served[tenant]
        self._num_waiting -= 1
        self._num_by_rank[request.priority_class.rank] -= 1
        return request

    def remove(self, request: Request) -> None:
        heap = self._heaps.get(request.tenant, [])
        kept = [item for item in heap if item[1] is not request]
        if len(kept) == len(heap):
            return
        self._num_waiting -= 1
        self._num_by_rank[request.priority_class.rank] -= 1
        if kept:
            heapq.heapify(kept)
            self._heaps[request.tenant] = kept
        else:
            del self._heaps[request.tenant]

    def charge(self, request: Request, num_tokens: int) -> None:
        """Count ``num_tokens`` computed for ``request`` against its tenant's share."""
        served = self._served.get(request.tenant, self._floor())
        self._served[request.tenant] = served + num_tokens / priority_weight(request.priority)

    def _prune(self, floor: float) -> None:
        """Forget tenants with nothing waiting whose count is at most the floor: they
        would start at the floor on their next push anyway, so nothing is lost, and the
        counts stay bounded by the tenants that are busy or ahead of the others."""
        idle = [t for t, n in self._served.items() if n <= floor and t not in self._heaps]
        for tenant in idle:
            del self._served[tenant]

    def served_tokens(self, tenant: str) -> float:
        """The tenant's weighted token count (for tests and metrics)."""
        return self._served.get(tenant, 0.0)

    @property
    def num_waiting_by_rank(self) -> tuple[int, ...]:
        """Waiting requests per class, most urgent first (index: ``PriorityClass.rank``)."""
        return tuple(self._num_by_rank)

    @property
    def num_tenants(self) -> int:
        """Tenants with at least one waiting request."""
        return len(self._heaps)

    def __len__(self) -> int:
        return self._num_waiting

    def __bool__(self) -> bool:
        return self._num_waiting > 0

    def __iter__(self) -> Iterator[Request]:
        return (item[1] for heap in self._heaps.values() for item in heap)
