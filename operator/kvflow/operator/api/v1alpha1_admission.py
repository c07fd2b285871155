"""The gateway's admission control in the InferencePool spec, version v1alpha1.

Split from ``v1alpha1`` (whose RouterSpec embeds it) to keep each file one concept. The
operator turns it into the router's --admission* flags (builders/router.py). Unset fields
keep the router's defaults, which the CEL rule below repeats so that a pool setting only one
threshold is refused by the API server, not by a crash-looping router;
tests/contracts holds them equal to the router's. Pure: imports neither kopf nor kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import CelRule, cel, field

# The router's defaults (kvflow.router.serving.admission).
ROUTER_SHED_QUEUE_TIME_S = 10.0
ROUTER_MAX_QUEUE_TIME_S = 30.0


@cel(
    CelRule(
        f"(has(self.shedQueueTimeSeconds) ? self.shedQueueTimeSeconds : "
        f"{ROUTER_SHED_QUEUE_TIME_S}) <= (has(self.maxQueueTimeSeconds) ? "
        f"self.maxQueueTimeSeconds : {ROUTER_MAX_QUEUE_TIME_S})",
        "router.admission.shedQueueTimeSeconds (default 10) must be at most "
        "maxQueueTimeSeconds (default 30)",
    )
)
@dataclass(frozen=True)
class AdmissionSpec:
    """Load shedding at the gateway, from the workers' estimated queue time
    (docs/router.md, Overload): past shedQueueTimeSeconds a tenant over its fair share of
    the requests in flight gets 429, past maxQueueTimeSeconds everyone gets 503, both with
    Retry-After. Unset fields keep the router's defaults."""

    enabled: bool = field(
        """false: the gateway admits everything (a worker with a full queue still refuses,
        and the client gets 503).""",
        True,
    )
    shed_queue_time_seconds: float | None = field(
        "Estimated queue time past which tenants over their share get 429 (router default 10).",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=3600,
    )
    max_queue_time_seconds: float | None = field(
        "Estimated queue time past which every request gets 503 (router default 30).",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=3600,
    )
    poll_interval_seconds: float | None = field(
        "How often each router reads every worker's queue (router default 0.5).",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=60,
    )
