"""The SLO planner's typed contract: what the operator feeds the model and what it gets back.

The model (`plan` in `model.py`) is a pure function

    plan(config: PlannerConfig, observations: Mapping[WorkerRole, Observation],
         state: PlannerState) -> Plan

called once per interval per pool. The operator gathers one `Observation` per worker role
(colocated, or prefill and decode), passes the `PlannerState` the previous call returned
(`PlannerState()` on the first call, or after an operator restart: the model then starts
cautious, see docs/planner.md), applies `Plan.decisions[*].replicas`, writes
`Plan.slo` as the SLOMet condition, and keeps `Plan.state` for the next call. Nothing here
reads a clock or a metric: every time is `Observation.time_s`, a monotonic second count
the caller chooses (the operator's loop clock; the benchmark's virtual clock).

Any metric may be None (not scraped, no traffic, the query failed); the model never reads a
None as zero and says in the decision's message which inputs it lacked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from kvflow.operator.builders.names import WorkerRole
from kvflow.operator.planner.forecast import Holt

__all__ = [
    "CapacityProfile",
    "Decision",
    "DecisionReason",
    "Observation",
    "Plan",
    "PlannerConfig",
    "PlannerState",
    "RoleConfig",
    "RoleState",
    "SloReason",
    "SloStatus",
    "SloVerdict",
    "Tuning",
    "WorkerRole",
]


@dataclass(frozen=True)
class Observation:
    """One role's metrics over the planner's sliding window, and its pods, at `time_s`.

    Every metric is the online classes' (realtime, normal): batch work fills spare
    capacity and is never a reason for a replica (docs/planner.md, "Batch work").

    Latencies are at the SLO's percentile (`PlannerConfig.percentile`) over the window;
    violation fractions are the share of the window's requests above the target. Per-replica
    figures are means over the role's ready replicas.
    """

    time_s: float  # monotonic seconds (any origin; only differences are used)
    desired_replicas: int  # what the role's Deployment asks for now
    ready_replicas: int
    pending_replicas: int = 0  # pods that exist but are not ready (starting, or unschedulable)
    # Of pending_replicas: pods the scheduler could not place (PodScheduled=False,
    # reason Unschedulable: no node with free GPUs). More replicas would only add more.
    unschedulable_replicas: int = 0
    # Requests that came for this role per second: served, and refused at the gateway by
    # admission control (shed_fraction of them), which are demand all the same.
    request_rate_per_s: float | None = None
    mean_input_tokens: float | None = None  # prompt tokens per request
    mean_output_tokens: float | None = None  # generated tokens per request
    ttft_s: float | None = None  # time to first token at the SLO percentile
    tpot_s: float | None = None  # time per output token at the SLO percentile
    # Share of requests over the TTFT target; a refused request never got a first token,
    # so the shed ones count as over it.
    ttft_violation_fraction: float | None = None
    tpot_violation_fraction: float | None = None  # share of requests over the TPOT target
    prefill_queue_wait_s: float | None = None  # mean wait before a prompt's first chunk
    decode_batch_size: float | None = None  # running (decoding) requests per ready replica
    kv_usage: float | None = None  # KV cache fill per ready replica, 0..1 (mean)
    # Requests queued for admission across the role's ready replicas, now (the sum of the
    # workers' kvflow_worker_requests_waiting). Optional: without it, no backlog sizing.
    num_waiting_requests: float | None = None
    # Share of the window's requests the gateway refused (429/503 from admission control:
    # the queues were past their time bound). None: no router read, or no request came.
    shed_fraction: float | None = None
    # Ready workers of the role with no window this interval: not read now, or not at the
    # last read. The counts above include their share, taken as the read ones' (observed
    # that way); with more than half unread the role is not scaled down (a scale-up still
    # acts).
    num_unread_workers: int = 0
    # Requests running on the role's ready replicas now (the sum of the workers'
    # kvflow_worker_requests_running): work that has not finished is not idleness.
    num_running_requests: float | None = None


@dataclass(frozen=True)
class CapacityProfile:
    """What one replica of a role sustains while meeting the SLO.

    Derive it from a simulated or measured step-time profile with
    `capacity.capacity_from_timing`, or give measured figures. Without one, the planner
    only reacts (violations, queue wait, KV usage) and cannot size ahead of load.
    """

    max_prompt_tokens_per_s: float  # prefill throughput that keeps TTFT within target
    # Output tokens/s one replica generates with TPOT within target (its batch at the
    # largest size the target, the KV cache and max_num_seqs allow, over that batch's step).
    max_decode_tokens_per_s: float
    source: str = ""  # where the numbers come from, for messages

    def __post_init__(self) -> None:
        if self.max_prompt_tokens_per_s <= 0 or self.max_decode_tokens_per_s <= 0:
            raise ValueError(
                f"capacity profile {self.source!r}: both capacities must be > 0 "
                f"(got {self.max_prompt_tokens_per_s} and {self.max_decode_tokens_per_s} tokens/s)"
            )


@dataclass(frozen=True)
class RoleConfig:
    """One role's bounds and whether the planner may move it."""

    spec_replicas: int  # RoleSpec.replicas: what the role runs when the planner may not move it
    min_replicas: int
    max_replicas: int
    # False: spec replicas win (autoscaling off, or the role named in the manual override).
    is_autoscaled: bool = True
    capacity: CapacityProfile | None = None


@dataclass(frozen=True)
class Tuning:
    """The model's thresholds. Defaults and their reasons are in docs/planner.md."""

    # Size for this share of a replica's SLO capacity; scale down only when the replicas
    # there run below scale_down_utilization (the gap is the hysteresis band), and then to
    # the band's middle.
    target_utilization: float = 0.8
    scale_down_utilization: float = 0.6
    # Above this many replica shares of load, the margin those utilisations leave grows as
    # the square root of the load, not in proportion to it (`replicas_for`). None: always
    # in proportion.
    pooled_from_shares: float | None = 4.0
    # Latency at the percentile under target x this: calm enough to consider removing a
    # replica (over target itself is a violation). The CRD's autoscaling.scaleDownLatencyRatio.
    scale_down_latency_ratio: float = 0.6
    # A reactive step never more than doubles a role (a latency ratio of 5 says "more", not
    # "5x": queues drain superlinearly once capacity exceeds load).
    max_scale_up_factor: float = 2.0
    # Prefill queue wait above this share of the TTFT target: prefill is short of replicas.
    queue_wait_ratio: float = 0.5
    # Without a profile, scale down only if each remaining replica would carry less than
    # this share of the request rate per replica at which the role last broke its SLO.
    saturation_headroom: float = 0.75
    # With a capacity profile and the queue length, size to drain the requests that will be
    # queued when a replica ordered now serves within this long, on top of the load.
    backlog_drain_s: float = 60.0
    kv_usage_high: float = 0.85  # above: preemptions are near; add decode capacity
    kv_usage_low: float = 0.5  # below (with the rest calm): KV does not block a scale-down
    # Holt's linear smoothing of the load (forecast.py); a forecast is capped at this many
    # times the load seen now.
    forecast_level_alpha: float = 0.5
    forecast_trend_beta: float = 0.3
    max_forecast_growth: float = 1.5
    # A slope seen now is trusted for this long on average (the damped trend, forecast.py):
    # 90 s ahead it adds 47 s of the trend, never more than 60 s.
    forecast_damping_s: float = 60.0

    def with_target(self, target_utilization: float) -> Tuning:
        """The same hysteresis band, moved to size for `target_utilization`."""
        if target_utilization == self.target_utilization:
            return self
        band = self.target_utilization - self.scale_down_utilization
        return replace(
            self,
            target_utilization=target_utilization,
            # Rounded, so 0.9 gives 0.7, not 0.7000000000000001.
            scale_down_utilization=round(target_utilization - band, 9),
        )

    def replicas_for(self, shares: float, utilization: float) -> int:
        """Replicas that carry `shares` of load with the margin `utilization` asks for.

        A margin absorbs the load's bursts, and Poisson arrivals spread R shares by about
        sqrt(R) shares: a pool's relative burst shrinks as it grows (square-root staffing).
        So up to `pooled_from_shares` (the pool size the defaults were tuned at, docs/
        planner.md) the margin is in proportion, R / u; above it, R + (1/u - 1) x
        sqrt(pooled_from_shares x R): equal at that point, smaller beyond (21 replicas
        where R / 0.8 takes 24, at 18.65 shares).
        """
        need = shares / utilization
        pooled = self.pooled_from_shares
        if pooled is not None and shares > pooled:
            need = shares + (1 / utilization - 1) * math.sqrt(pooled * shares)
        return math.ceil(need - 1e-9)


@dataclass(frozen=True)
class PlannerConfig:
    """The pool's SLO and autoscaling settings, in the model's units (see `config.py`)."""

    roles: dict[WorkerRole, RoleConfig]
    ttft_target_s: float
    tpot_target_s: float
    percentile: float = 90.0  # the targets hold at this percentile
    interval_s: float = 30.0
    scale_down_stabilization_s: float = 300.0
    scale_up_cooldown_s: float = 60.0
    # How long a new replica takes to serve (image pull, weights): the forecast horizon.
    replica_startup_s: float = 60.0
    enabled: bool = True
    tuning: Tuning = field(default_factory=Tuning)


@dataclass(frozen=True)
class RoleState:
    """What the model remembers about one role between intervals (immutable)."""

    role: WorkerRole
    replicas: int | None = None  # last decided; None before the first decision
    since_s: float | None = None  # first observation: a scale-down needs a full window of it
    # Holt forecasts of the role's loads: prompt tokens/s (prefill, colocated) and output
    # tokens/s (decode, colocated).
    prompt_load: Holt | None = None
    decode_load: Holt | None = None
    # Requests/s per ready replica when the role last broke its SLO (latency or queue).
    # Without a capacity profile it is the only thing that says how far fewer replicas
    # would stretch: a scale-down must leave each replica well under it.
    saturation_rate_per_replica: float | None = None
    # The larger share of requests over a latency target, last interval: falling while the
    # profile says the replicas suffice is a backlog draining, not a lack of replicas.
    last_violation_share: float | None = None
    # (time_s, replicas) the model wanted in each recent interval: a scale-down takes the
    # max over the stabilization window, so one quiet interval never removes a replica.
    recommendations: tuple[tuple[float, int], ...] = ()
    last_scale_up_s: float | None = None
    last_scale_down_s: float | None = None


@dataclass(frozen=True)
class PlannerState:
    """Everything carried between intervals; `PlannerState()` to start."""

    roles: tuple[RoleState, ...] = ()

    def role(self, role: WorkerRole) -> RoleState:
        return next((s for s in self.roles if s.role == role), RoleState(role=role))


# Bounded: used as a metrics label and a condition/Event reason (CamelCase).
DecisionReason = Literal[
    "AutoscalingDisabled",  # spec replicas: autoscaling is off
    "ManualOverride",  # spec replicas: the role is pinned in autoscaling.manualRoles
    "MetricsMissing",  # no usable input: replicas held
    "PrometheusUnavailable",  # autoscaling.prometheus gave no answer: replicas held
    "PrometheusNotAllowed",  # autoscaling.prometheus.url not allowed by the operator: held
    "TtftViolation",  # up: TTFT at the percentile over target
    "TpotViolation",  # up: TPOT at the percentile over target
    "QueueWait",  # up: prompts wait too long before prefill
    "KvPressure",  # up: KV cache nearly full (preemptions near)
    "ForecastLoad",  # up: the forecast load needs more replicas before the SLO breaks
    "Backlog",  # up: queued requests need replicas to drain while the load goes on
    "Underloaded",  # down: the load fits fewer replicas with the SLO met
    "Stabilizing",  # a scale-down is wanted but not for the whole stabilization window
    "Cooldown",  # more is wanted, but the last scale-up is too recent to judge
    "BacklogDraining",  # over target but improving, and the profile says there is room
    "PendingPods",  # more is wanted, but pods are Pending for lack of resources
    "AtMaxReplicas",  # more is wanted, but the role is at maxReplicas
    "BelowMinReplicas",  # raised to minReplicas
    "AboveMaxReplicas",  # lowered to maxReplicas
    "Steady",  # nothing to change
]

SloStatus = Literal["True", "False", "Unknown"]
SloReason = Literal[
    "WithinTargets",
    "TtftAboveTarget",
    "TpotAboveTarget",
    "TtftAndTpotAboveTarget",
    "AwaitingMetrics",  # no latency measured yet (no traffic, or not scraped)
    "PrometheusUnavailable",  # autoscaling.prometheus gave no answer: nothing measured
    "PrometheusNotAllowed",  # autoscaling.prometheus.url not allowed: nothing measured
    "AutoscalingDisabled",
]


@dataclass(frozen=True)
class Decision:
    """One role's replicas for the coming interval, and why."""

    role: WorkerRole
    replicas: int  # what the role's Deployment should ask for
    previous_replicas: int  # Observation.desired_replicas it was decided from
    reason: DecisionReason
    message: str  # for people: the numbers behind the reason

    @property
    def is_change(self) -> bool:
        return self.replicas != self.previous_replicas


@dataclass(frozen=True)
class SloVerdict:
    """The SLOMet condition the planner writes (status, CamelCase reason, message)."""

    status: SloStatus
    reason: SloReason
    message: str


@dataclass(frozen=True)
class Plan:
    """The model's answer for one interval."""

    decisions: tuple[Decision, ...]  # one per role observed, in the config's role order
    slo: SloVerdict
    state: PlannerState  # pass to the next call

    def decision(self, role: WorkerRole) -> Decision | None:
        return next((d for d in self.decisions if d.role == role), None)
