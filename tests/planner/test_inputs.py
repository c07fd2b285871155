"""Missing metrics, overrides, bounds, restarts and the state the model returns (pure)."""

from __future__ import annotations

import dataclasses

from planner.history import TPOT_S, TTFT_S, Run, calm, config

from kvflow.operator.planner import Observation, PlannerState, RoleConfig, plan

BLANK = {
    name: None
    for name in (
        "request_rate_per_s",
        "mean_input_tokens",
        "mean_output_tokens",
        "ttft_s",
        "tpot_s",
        "ttft_violation_fraction",
        "tpot_violation_fraction",
        "prefill_queue_wait_s",
        "decode_batch_size",
        "kv_usage",
    )
}


def test_no_metrics_holds_and_says_so() -> None:
    run = Run(config("colocated"))
    for i in range(20):
        d = run.step("colocated", calm(30 * i, 3, **BLANK))
        assert (d.replicas, d.reason) == (3, "MetricsMissing")
    for name in ("ttft_s", "tpot_s", "kv_usage", "prefill_queue_wait_s", "request_rate_per_s"):
        assert name in d.message


def test_a_missing_metric_never_reads_as_calm() -> None:
    # Everything calm but KV usage unknown: no scale-down in an hour, and the message says why.
    run = Run(config("decode"))
    for i in range(120):
        d = run.step("decode", calm(30 * i, 4, kv_usage=None))
        assert d.replicas == 4
    assert d.reason == "Steady" and "kv_usage" in d.message


def test_present_signals_still_act_when_others_are_missing() -> None:
    d = Run(config("prefill")).step(
        "prefill", calm(0, 2, ttft_s=None, ttft_violation_fraction=None, prefill_queue_wait_s=0.9)
    )
    assert (d.replicas, d.reason) == (4, "QueueWait")
    assert "ttft_s" in d.message


def test_capacity_sizing_needs_the_load() -> None:
    from planner.test_predictive import CAP

    # Queue calm, latency calm, but the request rate is unknown: no sizing, no scale-down.
    run = Run(config("prefill", capacity=CAP))
    for i in range(20):
        d = run.step("prefill", calm(30 * i, 5, request_rate_per_s=None))
    assert (d.replicas, d.reason) == (5, "Steady")
    assert "load unmeasured" in d.message and "request_rate_per_s" in d.message


def test_autoscaling_off_gives_spec_replicas_and_unknown_slo() -> None:
    cfg = dataclasses.replace(config("decode", replicas=3), enabled=False)
    result = plan(cfg, {"decode": calm(0, 5, tpot_s=5 * TPOT_S)}, PlannerState())
    d = result.decision("decode")
    assert d is not None and (d.replicas, d.reason) == (3, "AutoscalingDisabled")
    assert (result.slo.status, result.slo.reason) == ("Unknown", "AutoscalingDisabled")


def test_manual_override_pins_one_role_while_the_other_scales() -> None:
    cfg = config("prefill", replicas=2)
    roles = dict(cfg.roles)
    roles["decode"] = RoleConfig(
        spec_replicas=6, min_replicas=1, max_replicas=10, is_autoscaled=False
    )
    cfg = dataclasses.replace(cfg, roles=roles)
    hot = {"ttft_s": 2 * TTFT_S, "tpot_s": 3 * TPOT_S}
    result = Run(cfg).plan({"prefill": calm(0, 2, **hot), "decode": calm(0, 4, **hot)})
    assert [(d.role, d.replicas, d.reason) for d in result.decisions] == [
        ("prefill", 4, "TtftViolation"),
        ("decode", 6, "ManualOverride"),
    ]
    assert result.slo.status == "False"  # judged all the same


def test_bounds() -> None:
    hot = {"ttft_s": 3 * TTFT_S}
    d = Run(config("prefill", max_replicas=5)).step("prefill", calm(0, 4, **hot))
    assert (d.replicas, d.reason) == (5, "TtftViolation") and "maxReplicas 5" in d.message
    d = Run(config("prefill", max_replicas=5)).step("prefill", calm(0, 5, **hot))
    assert (d.replicas, d.reason) == (5, "AtMaxReplicas")
    d = Run(config("prefill", min_replicas=3)).step("prefill", calm(0, 1))
    assert (d.replicas, d.reason) == (3, "BelowMinReplicas")
    d = Run(config("prefill", max_replicas=4)).step("prefill", calm(0, 7))
    assert (d.replicas, d.reason) == (4, "AboveMaxReplicas")
    run = Run(config("prefill", min_replicas=2))
    replicas = 3
    for i in range(60):
        replicas = run.step("prefill", calm(30 * i, replicas)).replicas
        assert replicas >= 2
    assert replicas == 2


def test_a_restart_starts_cautious() -> None:
    # After 20 calm minutes the planner would shrink; a fresh state (operator restart) must
    # first watch a whole window again instead of acting on one sample.
    run = Run(config("prefill"))
    for i in range(40):
        run.step("prefill", calm(30 * i, 6))
    d = Run(config("prefill")).step("prefill", calm(1200, 6))
    assert (d.replicas, d.reason) == (6, "Stabilizing")


def test_state_is_immutable_and_the_model_deterministic() -> None:
    cfg = config("decode")
    state = PlannerState()
    obs: dict[str, Observation] = {"decode": calm(0, 2, tpot_s=2 * TPOT_S)}
    first = plan(cfg, obs, state)  # type: ignore[arg-type]
    again = plan(cfg, obs, state)  # type: ignore[arg-type]
    assert first == again and state == PlannerState()
    assert first.state.role("decode").last_scale_up_s == 0
    try:
        first.state.role("decode").replicas = 9  # type: ignore[misc]
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("state must be frozen")


def test_unobserved_roles_get_no_decision_and_keep_their_state() -> None:
    cfg = config("prefill")
    roles = dict(cfg.roles)
    roles["decode"] = RoleConfig(spec_replicas=2, min_replicas=1, max_replicas=10)
    run = Run(dataclasses.replace(cfg, roles=roles))
    run.plan({"prefill": calm(0, 2), "decode": calm(0, 2, tpot_s=3 * TPOT_S)})
    decode_state = run.state.role("decode")
    result = run.plan({"prefill": calm(30, 2)})
    assert [d.role for d in result.decisions] == ["prefill"]
    assert result.state.role("decode") == decode_state
