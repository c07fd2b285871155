"""The SLOMet verdict: is the pool meeting its TTFT and TPOT targets now? (pure)

TTFT is judged on the roles that prefill (prefill, colocated), TPOT on the roles that
decode (decode, colocated); a role reporting the other latency too (a decode worker's own
prefills) counts, and the worst role decides. A target is missed when its latency at the
SLO's percentile is over it, or when more than (100 - percentile) % of the window's
requests were (the two agree up to the histogram's buckets; either suffices; requests the
gateway refused count as over the TTFT target, since they got no first token). Unknown
when a latency is unmeasured and nothing is missed, or when no request came in the window:
silence is not compliance.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvflow.operator.planner.types import (
    Observation,
    PlannerConfig,
    SloReason,
    SloVerdict,
    WorkerRole,
)


def judge_slo(config: PlannerConfig, observations: Mapping[WorkerRole, Observation]) -> SloVerdict:
    if not config.enabled:
        return SloVerdict(
            "Unknown",
            "AutoscalingDisabled",
            "the planner judges the SLO when autoscaling is enabled",
        )
    budget = 1 - config.percentile / 100
    p = f"p{config.percentile:g}"
    observed = [o for r, o in observations.items() if r in config.roles]
    if observed and all(o.request_rate_per_s == 0 for o in observed):
        return SloVerdict("Unknown", "AwaitingMetrics", "no requests in the window")
    ttft = _worst([o.ttft_s for o in observed])
    tpot = _worst([o.tpot_s for o in observed])
    ttft_frac = _worst([o.ttft_violation_fraction for o in observed])
    tpot_frac = _worst([o.tpot_violation_fraction for o in observed])
    ttft_missed = _missed(ttft, config.ttft_target_s, ttft_frac, budget)
    tpot_missed = _missed(tpot, config.tpot_target_s, tpot_frac, budget)
    text = (
        f"TTFT {p} {_s(ttft)} (target {config.ttft_target_s:g} s), "
        f"TPOT {p} {_s(tpot)} (target {config.tpot_target_s:g} s)"
    )
    shed = _worst([o.shed_fraction for o in observed])
    if shed:  # the served requests' latencies hide the refused ones: say how many
        text += f"; {shed:.1%} of requests refused by admission control, counted as late"
    reason: SloReason
    if ttft_missed and tpot_missed:
        reason = "TtftAndTpotAboveTarget"
    elif ttft_missed:
        reason = "TtftAboveTarget"
    elif tpot_missed:
        reason = "TpotAboveTarget"
    elif ttft is None or tpot is None:
        return SloVerdict("Unknown", "AwaitingMetrics", f"{text}: not measured yet")
    else:
        return SloVerdict("True", "WithinTargets", text)
    return SloVerdict("False", reason, text)


def _worst(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _missed(latency_s: float | None, target_s: float, frac: float | None, budget: float) -> bool:
    return (latency_s is not None and latency_s > target_s) or (frac is not None and frac > budget)


def _s(value: float | None) -> str:
    return "unmeasured" if value is None else f"{value:.3g} s"
