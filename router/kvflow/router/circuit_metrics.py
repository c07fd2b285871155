"""The circuit breakers' metrics (kvflow.router.breaker; docs/router.md, "Circuit breaker"):
a gauge per pool and per worker (0 closed, 1 half-open, 2 open), read from the live pools
at scrape time, and a counter of transitions.

The worker gauge is a collector, not a labelled Gauge: it shows the pool's workers of the
moment, so a worker that left (a pod replaced, with a new address) leaves no series behind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvflow.router.breaker.machine import CircuitState
from kvflow.router.routing.types import WorkerId

# Every transition a breaker makes, (from, to): the counter's series exist from the start.
TRANSITIONS = (
    (CircuitState.CLOSED, CircuitState.OPEN),
    (CircuitState.OPEN, CircuitState.HALF_OPEN),
    (CircuitState.HALF_OPEN, CircuitState.OPEN),
    (CircuitState.HALF_OPEN, CircuitState.CLOSED),
)
SCOPES = ("worker", "pool")


class PoolCircuits(Protocol):
    """What the gauges read of a pool (workers/pool.py's WorkerPool)."""

    def circuit_state(self) -> CircuitState: ...

    def worker_circuits(self) -> Mapping[WorkerId, CircuitState]: ...


class _StateCollector(Collector):
    def __init__(self, pools: Mapping[str, PoolCircuits]) -> None:
        self._pools = dict(pools)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pools = GaugeMetricFamily(
            "kvflow_router_pool_circuit_state",
            "A pool's circuit breaker: 0 closed, 1 half-open, 2 open (its own, or every "
            "healthy worker's circuit open): its requests get 503 at once",
            labels=["pool"],
        )
        workers = GaugeMetricFamily(
            "kvflow_router_worker_circuit_state",
            "A worker's circuit breaker: 0 closed, 1 half-open (probes only), 2 open "
            "(routed nothing)",
            labels=["pool", "worker"],
        )
        for name, pool in self._pools.items():
            pools.add_metric([name], float(pool.circuit_state()))
            for worker, state in sorted(pool.worker_circuits().items()):
                workers.add_metric([name, worker], float(state))
        yield pools
        yield workers


class CircuitMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self.transitions = Counter(
            "kvflow_router_circuit_transitions_total",
            "Circuit breaker state changes, by pool, scope (a worker's circuit or the "
            "pool's own) and the states left and entered",
            ["pool", "scope", "from_state", "to_state"],
            registry=registry,
        )

    def watch(self, pools: Mapping[str, PoolCircuits]) -> None:
        """Gauges for these pools, by name; their transition series at 0."""
        for name in pools:
            for scope in SCOPES:
                for was, to in TRANSITIONS:
                    self.transitions.labels(name, scope, was.label, to.label)
        self._registry.register(_StateCollector(pools))

    def count(self, pool: str, scope: str, was: CircuitState, to: CircuitState) -> None:
        self.transitions.labels(pool, scope, was.label, to.label).inc()
