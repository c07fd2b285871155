"""Gateway admission control, pure: admit, 429 or 503 from the workers' estimated queues.

Past saturation every request a gateway lets through makes every later one wait longer;
latency grows until clients time out (and retry into the same queues). The gateway sheds
instead, from each eligible worker's queue as it reports it (Load: requests waiting, the
rate at which they are admitted, the queue's bound):

- **estimated wait** of a worker = (waiting + this router's dispatches since the report,
  spread over the eligible workers) / admissions per second; of the cluster = the best
  worker's (routing sends a request to a short queue, and the worker queues are fair).
- above ``max_queue_time_s``, or when every eligible worker's queue is at its bound (each
  would refuse with RESOURCE_EXHAUSTED): **503**, the cluster is full, for everyone.
- above ``shed_queue_time_s``: **429** for a tenant over its fair share of this router's
  requests in flight (share weighted by priority, as on the workers); the others still get
  in, so one tenant's burst is shed first.

A request's priority class (kvflow.proto.priority_class) moves where it is shed, so the
cluster sheds in ``SHED_ORDER``, batch first, then normal, and keeps realtime:

- **batch**: 503 already above ``shed_queue_time_s``, whatever its tenant's share (batch
  work fills spare capacity; a busy cluster has none), reason ``batch_shed``.
- **normal**: as above (429 over share past the shed time, 503 past the max).
- **realtime**: admitted; the workers judge. A worker runs it before everything else and
  bounds its queue per class (a full queue of normal and batch work still takes it:
  engine_worker core/queue_limits.py), so the queue this router sees is not the one a
  realtime request waits behind; a worker whose realtime requests alone fill its bound
  refuses, and the router tries another, then answers 503 with Retry-After.

Retry-After is the time the best queue needs to drain back under the threshold crossed.
The shares are this replica's view: N router replicas each judge their own traffic.
Configured by the router's --admission* flags (router/cli.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvflow.proto.priority_class import PriorityClass
from kvflow.router.routing.types import WorkerId

MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


class AdmissionConfigError(ValueError):
    """An admission setting is invalid; the message names the flag."""


# The router's flags, one per field (router/cli.py): messages name what the operator types.
ADMISSION_FLAGS = {
    "shed_queue_time_s": "--admission-shed-queue-time-s",
    "max_queue_time_s": "--admission-max-queue-time-s",
    "poll_interval_s": "--admission-poll-interval-s",
}
# The environment variables of the first release; a router with one set refuses to start
# (router/cli.py) rather than ignore it: a deployment that set them would silently shed
# at the defaults instead.
REMOVED_ENV = {
    "KVFLOW_ADMISSION": "--admission on|off",
    "KVFLOW_ADMISSION_SHED_QUEUE_TIME_S": ADMISSION_FLAGS["shed_queue_time_s"],
    "KVFLOW_ADMISSION_MAX_QUEUE_TIME_S": ADMISSION_FLAGS["max_queue_time_s"],
    "KVFLOW_ADMISSION_POLL_INTERVAL_S": ADMISSION_FLAGS["poll_interval_s"],
}


# 10 s of queue is already past what an interactive client tolerates before its first
# token; 30 s is where clients with default timeouts start giving up and retrying.
DEFAULT_SHED_QUEUE_TIME_S = 10.0
DEFAULT_MAX_QUEUE_TIME_S = 30.0
# The oldest a worker's queue report may be: the pool's one Load poll runs at the shorter
# of this and its own interval (api/backend.py); between reports admissions are counted in.
DEFAULT_POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class AdmissionConfig:
    shed_queue_time_s: float = DEFAULT_SHED_QUEUE_TIME_S
    max_queue_time_s: float = DEFAULT_MAX_QUEUE_TIME_S
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    is_enabled: bool = True

    def __post_init__(self) -> None:
        for name, flag in ADMISSION_FLAGS.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise AdmissionConfigError(f"{flag} must be a number of seconds > 0, got {value}")
        if self.shed_queue_time_s > self.max_queue_time_s:
            shed, most = ADMISSION_FLAGS["shed_queue_time_s"], ADMISSION_FLAGS["max_queue_time_s"]
            raise AdmissionConfigError(
                f"{shed} ({self.shed_queue_time_s:g}) must be at most {most} "
                f"({self.max_queue_time_s:g}): tenants over their share are shed first, then "
                f"everyone; raise {most} or lower {shed}"
            )


def removed_env_problem(env: Mapping[str, str]) -> str | None:
    """What to do instead, when ``env`` still sets a removed KVFLOW_ADMISSION* variable."""
    found = sorted(name for name in REMOVED_ENV if name in env)
    if not found:
        return None
    flags = " ".join(REMOVED_ENV[name] for name in found)
    return (f"{', '.join(found)} is no longer read (admission is configured by flags): "
            f"unset it and pass {flags} instead")  # fmt: skip


@dataclass(frozen=True)
class WorkerQueue:
    """One worker's waiting queue as it last reported it."""

    worker_id: WorkerId
    num_waiting: int
    max_waiting_requests: int  # 0: unbounded
    drain_rate_per_s: float  # admissions per second while backlogged; 0: not measured

    @property
    def is_full(self) -> bool:
        return 0 < self.max_waiting_requests <= self.num_waiting

    def estimated_wait_s(self, num_extra: float = 0.0) -> float:
        """Seconds until a new request would be admitted; 0 when nothing waits, and when
        the rate is unknown (a queue that never backlogged is short, and the count bound
        catches the rest)."""
        ahead = self.num_waiting + num_extra
        if ahead < 1 or self.drain_rate_per_s <= 0:
            return 0.0
        return ahead / self.drain_rate_per_s


@dataclass(frozen=True)
class TenantLoad:
    """This router's requests in flight: the caller's tenant's, and everyone's, with the
    summed weights of the tenants that have any (the caller's tenant included)."""

    num_in_flight: int
    weight: float
    num_in_flight_total: int
    active_weight_total: float
    num_active_tenants: int

    def is_over_share(self) -> bool:
        """Would one more request put this tenant over its weighted share of what is in
        flight? Never while it is the only tenant with requests in flight."""
        if self.num_active_tenants <= 1:
            return False
        share = (self.num_in_flight_total + 1) * self.weight / self.active_weight_total
        return self.num_in_flight + 1 > share


@dataclass(frozen=True)
class Verdict:
    status: int  # 200: admitted; 429 or 503
    reason: str  # "admitted", "over_share", "batch_shed", "cluster_full", "queues_full"
    estimated_wait_s: float
    retry_after_s: float = 0.0

    @property
    def is_admitted(self) -> bool:
        return self.status == 200


def _retry_after_s(seconds: float) -> float:
    return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, seconds))


def decide(
    queues: Sequence[WorkerQueue],
    num_dispatched_since_report: int,
    tenant: TenantLoad,
    config: AdmissionConfig,
    priority_class: PriorityClass = PriorityClass.NORMAL,
) -> Verdict:
    """Admit, or refuse with a status and a Retry-After; ``queues`` are the eligible
    workers' (none known yet: admit, the pool answers for a cluster with no worker)."""
    if not config.is_enabled or not queues:
        return Verdict(200, "admitted", 0.0)
    extra = num_dispatched_since_report / len(queues)
    best = min(queues, key=lambda q: (q.is_full, q.estimated_wait_s(extra)))
    wait_s = best.estimated_wait_s(extra)
    if priority_class is PriorityClass.REALTIME:
        return Verdict(200, "admitted", wait_s)
    if best.is_full:
        # Every queue is at its bound: the time for the best to drain by one is when a
        # retry could get in.
        one_s = 1.0 / best.drain_rate_per_s if best.drain_rate_per_s > 0 else 1.0
        return Verdict(503, "queues_full", wait_s, _retry_after_s(one_s))
    if priority_class is PriorityClass.BATCH and wait_s > config.shed_queue_time_s:
        return Verdict(503, "batch_shed", wait_s,
                       _retry_after_s(wait_s - config.shed_queue_time_s))  # fmt: skip
    if wait_s > config.max_queue_time_s:
        return Verdict(503, "cluster_full", wait_s,
                       _retry_after_s(wait_s - config.max_queue_time_s))  # fmt: skip
    if wait_s > config.shed_queue_time_s and tenant.is_over_share():
        return Verdict(429, "over_share", wait_s,
                       _retry_after_s(wait_s - config.shed_queue_time_s))  # fmt: skip
    return Verdict(200, "admitted", wait_s)
