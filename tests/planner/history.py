"""Helpers for the planner's pure tests: observations, configs, and a closed loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.operator.planner import (
    CapacityProfile,
    Decision,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    RoleConfig,
    WorkerRole,
    plan,
)

TTFT_S = 1.0
TPOT_S = 0.1


def calm(time_s: float, replicas: int, **metrics: Any) -> Observation:
    """A role well inside its SLO, with every metric present."""
    base: dict[str, Any] = {
        "request_rate_per_s": 10.0,
        "mean_input_tokens": 1000.0,
        "mean_output_tokens": 200.0,
        "ttft_s": 0.2 * TTFT_S,
        "tpot_s": 0.2 * TPOT_S,
        "ttft_violation_fraction": 0.0,
        "tpot_violation_fraction": 0.0,
        "prefill_queue_wait_s": 0.0,
        "decode_batch_size": 4.0,
        "kv_usage": 0.2,
    }
    base.update(metrics)
    return Observation(time_s=time_s, desired_replicas=replicas, ready_replicas=replicas, **base)


def config(
    role: WorkerRole = "prefill",
    *,
    replicas: int = 2,
    min_replicas: int = 1,
    max_replicas: int = 10,
    capacity: CapacityProfile | None = None,
    **settings: Any,
) -> PlannerConfig:
    roles = {
        role: RoleConfig(
            spec_replicas=replicas,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            capacity=capacity,
        )
    }
    base: dict[str, Any] = {
        "ttft_target_s": TTFT_S,
        "tpot_target_s": TPOT_S,
        "interval_s": 30.0,
        "scale_down_stabilization_s": 300.0,
        "scale_up_cooldown_s": 60.0,
        "replica_startup_s": 60.0,
    }
    base.update(settings)
    return PlannerConfig(roles=roles, **base)


@dataclass
class Run:
    """Observations fed one by one; each plan's state goes into the next call."""

    config: PlannerConfig
    state: PlannerState = field(default_factory=PlannerState)

    def step(self, role: WorkerRole, obs: Observation) -> Decision:
        result = self.plan({role: obs})
        decision = result.decision(role)
        assert decision is not None
        return decision

    def plan(self, observations: dict[WorkerRole, Observation]) -> Plan:
        result = plan(self.config, observations, self.state)
        self.state = result.state
        return result


def closed_loop(
    cfg: PlannerConfig,
    role: WorkerRole,
    obs_at: Callable[[float, int], Observation],
    *,
    num_steps: int,
    replicas: int,
) -> list[Decision]:
    """Every interval: observe with the replicas last decided (ready at once), decide."""
    run = Run(cfg)
    decisions = []
    for i in range(num_steps):
        decision = run.step(role, obs_at(i * cfg.interval_s, replicas))
        replicas = decision.replicas
        decisions.append(decision)
    return decisions


def with_ready(obs: Observation, ready: int, unschedulable: int = 0) -> Observation:
    pending = obs.desired_replicas - ready
    return replace(
        obs, ready_replicas=ready, pending_replicas=pending, unschedulable_replicas=unschedulable
    )
