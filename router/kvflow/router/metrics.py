"""The router's Prometheus metrics, in a registry the app owns (no module-level globals).

Names follow `kvflow_router_<what>_<unit>`. Per-tenant labels are safe: tenants come from
the configuration, so their number is bounded.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Routing decisions take tens of microseconds to a few milliseconds.
_DECISION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvflow_router_requests_total",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        self.ttft_s = Histogram(
            "kvflow_router_ttft_seconds",
            "Request arrival at the gateway to its first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "kvflow_router_e2e_seconds",
            "Request arrival at the gateway to its last token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decision_s = Histogram(
            "kvflow_router_routing_decision_seconds",
            "Time to choose a worker: block hashing, index lookup, scoring",
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.matched_blocks = Counter(
            "kvflow_router_prefix_matched_blocks_total",
            "Prompt blocks the chosen worker already cached, per the router's index",
            registry=r,
        )
        self.failovers = Counter(
            "kvflow_router_failovers_total",
            "Requests moved to another worker after one failed before the first token",
            registry=r,
        )
        self.tenant_requests = Counter(
            "kvflow_router_tenant_requests_total", "Admitted requests", ["tenant"], registry=r
        )
        self.tenant_prompt_tokens = Counter(
            "kvflow_router_tenant_prompt_tokens_total", "Prompt tokens", ["tenant"], registry=r
        )
        self.tenant_completion_tokens = Counter(
            "kvflow_router_tenant_completion_tokens_total",
            "Completion tokens",
            ["tenant"],
            registry=r,
        )
        self.tenant_cached_tokens = Counter(
            "kvflow_router_tenant_cached_tokens_total",
            "Prompt tokens served from a worker's prefix cache",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "kvflow_router_tenant_rejections_total",
            "Requests refused by a quota or rate limit",
            ["tenant", "limit"],
            registry=r,
        )
        self._workers_healthy = Gauge(
            "kvflow_router_workers_healthy", "Workers passing health probes", registry=r
        )
        self._workers_known = Gauge(
            "kvflow_router_workers", "Workers known from discovery", registry=r
        )
        self._index_blocks = Gauge(
            "kvflow_router_index_blocks", "Distinct block hashes in the routing index", registry=r
        )

    def watch(
        self,
        num_healthy: Callable[[], float],
        num_known: Callable[[], float],
        num_index_blocks: Callable[[], float],
    ) -> None:
        """Gauges read at scrape time from the live objects."""
        self._workers_healthy.set_function(num_healthy)
        self._workers_known.set_function(num_known)
        self._index_blocks.set_function(num_index_blocks)
