"""The planner's configuration from an InferencePool spec (pure)."""

from __future__ import annotations

from dataclasses import replace

from kvflow.operator.api import v1alpha1, v1alpha1_planner
from kvflow.operator.builders.names import worker_roles
from kvflow.operator.planner.types import CapacityProfile, PlannerConfig, RoleConfig, Tuning


def capacity_from_spec(spec: v1alpha1_planner.AutoscalingSpec) -> CapacityProfile | None:
    """The per-replica capacity the spec states, or None (the CRD asks for both or neither)."""
    tokens_per_s = spec.replica_prompt_tokens_per_second
    decode_per_s = spec.replica_decode_tokens_per_second
    if tokens_per_s is None or decode_per_s is None:
        return None
    return CapacityProfile(
        max_prompt_tokens_per_s=tokens_per_s,
        max_decode_tokens_per_s=decode_per_s,
        source="autoscaling.replicaPromptTokensPerSecond/replicaDecodeTokensPerSecond",
    )


def config_from_spec(
    spec: v1alpha1.InferencePoolSpec,
    *,
    capacity: CapacityProfile | None = None,
    tuning: Tuning | None = None,
) -> PlannerConfig:
    """`capacity` overrides the spec's (a benchmark passes one derived from a profile)."""
    auto = spec.autoscaling
    cap = capacity if capacity is not None else capacity_from_spec(auto)
    roles = {
        role: RoleConfig(
            spec_replicas=rs.replicas,
            min_replicas=rs.min_replicas,
            max_replicas=rs.max_replicas,
            is_autoscaled=role not in auto.manual_roles,
            capacity=cap,
        )
        for role, rs in worker_roles(spec)
    }
    return PlannerConfig(
        roles=roles,
        ttft_target_s=spec.slo.ttft_target_ms / 1000,
        tpot_target_s=spec.slo.tpot_target_ms / 1000,
        percentile=spec.slo.percentile,
        interval_s=float(auto.interval_seconds),
        scale_down_stabilization_s=float(auto.scale_down_stabilization_seconds),
        scale_up_cooldown_s=float(auto.scale_up_cooldown_seconds),
        replica_startup_s=float(auto.replica_startup_seconds),
        enabled=auto.enabled,
        tuning=tuning if tuning is not None else _tuning(auto),
    )


def _tuning(auto: v1alpha1_planner.AutoscalingSpec) -> Tuning:
    """The model's thresholds with the two the user sets: the margin and the calm gate."""
    tuning = Tuning().with_target(auto.target_utilization)
    return replace(tuning, scale_down_latency_ratio=auto.scale_down_latency_ratio)
