"""The router's circuit breaker in the RouterSpec, version v1alpha1 (docs/router.md,
"Circuit breaker").

Split from ``v1alpha1_router`` (whose RouterSpec embeds it) to keep each file one concept.
The operator turns it into the router's --breaker* flags (builders/router_features.py),
only for values that differ from the router's defaults, which the defaults here repeat
(tests/operator/test_router_features.py holds them equal). Pure: imports neither kopf nor
kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import CelRule, cel, field

# The router's defaults (kvflow.router.breaker.machine).
ROUTER_ERROR_RATE = 0.5
ROUTER_WINDOW_S = 30.0
ROUTER_MIN_REQUESTS = 10
ROUTER_OPEN_S = 10.0
ROUTER_MAX_OPEN_S = 300.0
ROUTER_HALF_OPEN_PROBES = 2


@cel(
    CelRule(
        "self.openSeconds <= self.maxOpenSeconds",
        "router.circuitBreaker.openSeconds must be at most maxOpenSeconds",
        ".openSeconds",
    )
)
@dataclass(frozen=True)
class CircuitBreakerSpec:
    """Stop sending to a worker (or answering for a pool) whose requests fail or stall too
    often, and probe it again after a while. A worker's circuit opens at once on a stalled
    stream; otherwise when errorRateThreshold of at least minRequests requests in the
    window failed."""

    enabled: bool = field("false: circuits stay closed.", True)
    error_rate_threshold: float = field(
        "The share of failed requests (errors and timeouts) in the window that opens it.",
        ROUTER_ERROR_RATE,
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
    )
    window_seconds: float = field(
        "The sliding window the share is taken over.",
        ROUTER_WINDOW_S,
        minimum=0,
        exclusive_minimum=True,
        maximum=3600,
    )
    min_requests: int = field(
        "The fewest requests in the window the share is judged from.",
        ROUTER_MIN_REQUESTS,
        minimum=1,
        maximum=1_000_000,
    )
    open_seconds: float = field(
        "How long a circuit stays open before probes; doubled for each re-open in a row.",
        ROUTER_OPEN_S,
        minimum=0,
        exclusive_minimum=True,
        maximum=86400,
    )
    max_open_seconds: float = field(
        "The longest a circuit stays open, however often it re-opens.",
        ROUTER_MAX_OPEN_S,
        minimum=0,
        exclusive_minimum=True,
        maximum=86400,
    )
    half_open_probes: int = field(
        """Requests a half-open circuit lets through; that many successes close it, one
        failure re-opens it.""",
        ROUTER_HALF_OPEN_PROBES,
        minimum=1,
        maximum=1000,
    )
