"""PlannerConfig from an InferencePool spec."""

from __future__ import annotations

from kvflow.operator.api import schema, v1alpha1
from kvflow.operator.planner import config_from_spec


def _spec(**autoscaling: object) -> v1alpha1.InferencePoolSpec:
    body = {
        "model": {"servedName": "m"},
        "mode": "disaggregated",
        "prefill": {"replicas": 2, "minReplicas": 1, "maxReplicas": 6},
        "decode": {"replicas": 3, "maxReplicas": 12},
        "slo": {"ttftTargetMs": 800, "tpotTargetMs": 40, "percentile": 95},
        "autoscaling": {"enabled": True, **autoscaling},
    }
    return schema.from_json(v1alpha1.InferencePoolSpec, body)


def test_config_from_spec() -> None:
    cfg = config_from_spec(
        _spec(
            manualRoles=["decode"],
            scaleUpCooldownSeconds=45,
            replicaStartupSeconds=120,
            replicaPromptTokensPerSecond=20000,
            replicaDecodeTokensPerSecond=5000,
            targetUtilization=0.9,
            scaleDownLatencyRatio=0.8,
        )
    )
    assert (cfg.ttft_target_s, cfg.tpot_target_s, cfg.percentile) == (0.8, 0.04, 95)
    assert (cfg.scale_up_cooldown_s, cfg.replica_startup_s, cfg.interval_s) == (45, 120, 30)
    assert list(cfg.roles) == ["prefill", "decode"]
    prefill, decode = cfg.roles["prefill"], cfg.roles["decode"]
    assert (prefill.spec_replicas, prefill.min_replicas, prefill.max_replicas) == (2, 1, 6)
    assert prefill.is_autoscaled and not decode.is_autoscaled
    assert prefill.capacity is not None and prefill.capacity.max_prompt_tokens_per_s == 20000
    assert prefill.capacity.max_decode_tokens_per_s == 5000
    # The band keeps its width (0.2) under the target it is moved to.
    assert (cfg.tuning.target_utilization, cfg.tuning.scale_down_utilization) == (0.9, 0.7)
    assert cfg.tuning.scale_down_latency_ratio == 0.8  # the calm gate is the user's too


def test_no_capacity_in_the_spec() -> None:
    cfg = config_from_spec(_spec())
    assert cfg.roles["prefill"].capacity is None and cfg.enabled
    assert (cfg.tuning.target_utilization, cfg.tuning.scale_down_utilization) == (0.8, 0.6)
    assert cfg.tuning.scale_down_latency_ratio == 0.6
