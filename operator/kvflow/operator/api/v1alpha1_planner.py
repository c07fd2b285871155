"""The InferencePool's planner spec, version v1alpha1: SLO targets and autoscaling.

Split from ``v1alpha1`` (which embeds these in InferencePoolSpec) to keep each file one
concept. Descriptions are what `kubectl explain` prints. Pure: imports neither kopf nor
kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, cel, field

WorkerRoleName = Literal["colocated", "prefill", "decode"]


@dataclass(frozen=True)
class SloSpec:
    """Latency targets the planner scales for."""

    ttft_target_ms: int = field("Time to first token target, ms.", 1000, minimum=1, maximum=600000)
    tpot_target_ms: int = field("Time per output token target, ms.", 100, minimum=1, maximum=60000)
    percentile: float = field(
        "Percentile the targets apply to (90 means p90).", 90.0, minimum=50, maximum=99.99
    )


@dataclass(frozen=True)
class PrometheusSource:
    """A Prometheus that scrapes the pool's workers and routers: the planner reads its
    inputs with PromQL over its HTTP API instead of scraping the pods itself."""

    url: str = field(
        """Base URL of the Prometheus HTTP API (the planner calls <url>/api/v1/query), e.g.
        http://prometheus-operated.monitoring:9090. Its kvflow series must carry the labels
        namespace, pool and role, as the chart's PodMonitors add them.""",
        pattern="^https?://[^\\s]+$",
        max_length=2048,
    )
    window_seconds: int | None = field(
        """The window rates, percentiles and violation shares are taken over (PromQL
        increase over it). Unset: intervalSeconds. Give it at least two scrape intervals
        (four is Prometheus' advice for rates): with fewer, a series has no increase.""",
        None,
        minimum=5,
        maximum=3600,
    )


@cel(
    CelRule(
        "has(self.replicaPromptTokensPerSecond) == has(self.replicaDecodeTokensPerSecond)",
        "autoscaling takes both replicaPromptTokensPerSecond and replicaDecodeTokensPerSecond, "
        "or neither",
    )
)
@dataclass(frozen=True)
class AutoscalingSpec:
    """The SLO planner: moves each role's replicas within [minReplicas, maxReplicas].

    Prefill replicas follow TTFT, prompt-token load and queue wait; decode replicas follow
    TPOT, decode concurrency and KV usage (docs/planner.md). With the per-replica capacity
    below, the planner also sizes each role for the load it forecasts one replica start-up
    ahead, so new replicas are ready before the SLO breaks.
    """

    enabled: bool = field("Let the planner change replicas.", False)
    interval_seconds: int = field("Seconds between planner decisions.", 30, minimum=5, maximum=3600)
    scale_down_stabilization_seconds: int = field(
        """A scale-down must be wanted this long before it happens (the planner takes the
        most replicas it wanted over this window).""",
        300,
        minimum=0,
        maximum=86400,
    )
    scale_up_cooldown_seconds: int = field(
        """After a scale-up, the planner waits this long before adding more on latency
        alone (the new replicas need time to take load).""",
        60,
        minimum=0,
        maximum=3600,
    )
    replica_startup_seconds: int = field(
        """How long a new worker takes to serve (image pull, weight loading): the planner
        forecasts load this far ahead.""",
        60,
        minimum=0,
        maximum=3600,
    )
    manual_roles: list[WorkerRoleName] = field(
        """Roles whose replicas stay as written in the spec while the planner runs
        (a manual override; the planner still judges SLOMet).""",
        [],
        max_items=3,
    )
    replica_prompt_tokens_per_second: float | None = field(
        """Prompt tokens per second one worker prefills with TTFT within target (measured,
        or derived from a step-time profile: docs/planner.md). Unset: no forecast sizing.""",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    replica_decode_tokens_per_second: float | None = field(
        """Output tokens per second one worker generates with TPOT within target (its
        largest batch within TPOT, KV and maxNumSeqs, over that batch's step time). Set
        together with replicaPromptTokensPerSecond.""",
        None,
        minimum=0,
        exclusive_minimum=True,
    )
    target_utilization: float = field(
        """With a per-replica capacity, size each role for its load at this share of that
        capacity (the margin for bursts and the profile's error; above 4 replicas' worth of
        load the margin is pooled, docs/planner.md). A role shrinks when its replicas run
        0.2 below it. Higher runs fewer GPUs, closer to the SLO's edge.""",
        0.8,
        minimum=0.4,
        maximum=0.95,
    )
    scale_down_latency_ratio: float = field(
        """A role shrinks only while its TTFT and TPOT at the percentile are under this
        share of their targets (the latency calm gate). Higher lets a pool that runs close
        to its targetUtilization shrink sooner after a peak, with less room left before
        the SLO's edge.""",
        0.6,
        minimum=0.3,
        maximum=0.95,
    )
    prometheus: PrometheusSource | None = field(
        """Read the planner's inputs from this Prometheus. Unset: the operator scrapes the
        workers' and routers' /metrics itself. Unreachable: the planner holds replicas and
        says so (reason PrometheusUnavailable).""",
        None,
    )
