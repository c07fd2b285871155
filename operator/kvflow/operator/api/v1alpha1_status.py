"""The InferencePool's status types, version v1alpha1 (re-exported by ``v1alpha1``).

Written by the operator only; what `kubectl get kvpool -o yaml` shows under ``status``.
Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import field
from kvflow.operator.api.v1alpha1_planner import WorkerRoleName

ConditionStatus = Literal["True", "False", "Unknown"]
Phase = Literal["Pending", "Progressing", "Ready", "Degraded"]
RoleName = Literal["colocated", "prefill", "decode", "router"]


@dataclass(frozen=True)
class Condition:
    """One aspect of the pool's state (metav1.Condition)."""

    type: str = field("Ready, Progressing, Degraded or SLOMet.")
    status: ConditionStatus = field("True, False or Unknown.")
    reason: str = field("CamelCase reason for the status.")
    message: str = field("What happened, for people.", "")
    last_transition_time: str = field("When status last changed (RFC 3339).", "")
    observed_generation: int = field("The pool generation this was computed from.", 0)


@dataclass(frozen=True)
class RoleStatus:
    """Replicas of one role's Deployment as last observed."""

    name: RoleName = field("colocated, prefill, decode or router.")
    desired_replicas: int = field("Replicas the operator asked for.", 0)
    ready_replicas: int = field("Ready pods.", 0)
    updated_replicas: int = field("Pods of the current template.", 0)


@dataclass(frozen=True)
class PlannedReplicas:
    """The replicas the planner chose for one role."""

    name: WorkerRoleName = field("colocated, prefill or decode.")
    replicas: int = field("Replicas the operator applies to the role's Deployment.", 0)


@dataclass(frozen=True)
class PlannerStatus:
    """The SLO planner's last decision."""

    roles: list[PlannedReplicas] = field(
        """Replicas per role the planner decided; the operator applies them (here, not in
        the spec, so the spec stays what the user wrote and survives operator restarts).""",
        [],
        map_keys=("name",),
    )
    last_decision: str = field("e.g. 'decode 2->3'; empty before the first.", "")
    reason: str = field("Why, with the measured latencies.", "")
    decided_at: str = field("When (RFC 3339).", "")


@dataclass(frozen=True)
class InferencePoolStatus:
    """What the operator observed and did (written by the operator only)."""

    phase: Phase = field("Pending, Progressing, Ready or Degraded.", "Pending")
    observed_generation: int = field("The spec generation last reconciled.", 0)
    conditions: list[Condition] = field(
        "Ready, Progressing, Degraded, SLOMet.", [], map_keys=("type",)
    )
    roles: list[RoleStatus] = field("Per-role replicas.", [], map_keys=("name",))
    desired_replicas: int = field("Worker pods asked for, all roles.", 0)
    ready_replicas: int = field("Ready worker pods, all roles.", 0)
    gateway_endpoint: str = field("In-cluster URL of the OpenAI API (.../v1).", "")
    planner: PlannerStatus = field("Autoscaling decisions.", PlannerStatus())
