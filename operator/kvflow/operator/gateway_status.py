"""An InferenceGateway's status, and its InferenceModels', from observations (pure).

Conditions keep their lastTransitionTime while their status holds, as a pool's do.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.operator.api.v1alpha1_gateway import (
    GatewayPhase,
    InferenceGatewayStatus,
    InferenceModelStatus,
    ResolvedModel,
)
from kvflow.operator.api.v1alpha1_status import Condition, ConditionStatus
from kvflow.operator.builders.gateway_models import GatewayProblem, ModelVerdict
from kvflow.operator.status import DeploymentObservation


def condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    before: Sequence[Condition],
    now: str,
    generation: int,
) -> Condition:
    previous = next((c for c in before if c.type == type_), None)
    unchanged = previous is not None and previous.status == status
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message[:1024],
        last_transition_time=previous.last_transition_time
        if unchanged and previous and previous.last_transition_time
        else now,
        observed_generation=generation,
    )


def gateway_status(
    *,
    generation: int,
    endpoint: str,
    models: Sequence[ResolvedModel],
    replicas: int,
    deployment: DeploymentObservation | None,
    problems: Sequence[GatewayProblem],
    previous: InferenceGatewayStatus,
    now: str,
) -> InferenceGatewayStatus:
    """`replicas`: the routers asked for (0 while no model can be served); `deployment`:
    the router Deployment as observed, None before it exists."""
    ready_routers = deployment.ready_replicas if deployment is not None else 0
    ready: tuple[ConditionStatus, str, str]
    if not models:
        ready = ("False", "NoModels", "no InferenceModel this gateway can serve names it")
    elif deployment is None:
        ready = ("False", "Creating", "creating the router Deployment")
    elif not deployment.is_rolled_out(replicas):
        ready = ("False", "RollingOut", f"routers {ready_routers}/{replicas} ready")
    else:
        ready = ("True", "RoutersReady", f"routers {ready_routers}/{replicas} ready")
    if problems:
        text = "; ".join(p.message for p in problems)
        degraded: tuple[ConditionStatus, str, str] = ("True", problems[0].reason, text)
    else:
        degraded = ("False", "AsExpected", "")
    phase: GatewayPhase
    if degraded[0] == "True":
        phase = "Degraded"
    elif ready[0] == "True":
        phase = "Ready"
    elif deployment is None or not models:
        phase = "Pending"
    else:
        phase = "Progressing"
    before = previous.conditions
    return InferenceGatewayStatus(
        phase=phase,
        observed_generation=generation,
        conditions=[
            condition("Ready", *ready, before=before, now=now, generation=generation),
            condition("Degraded", *degraded, before=before, now=now, generation=generation),
        ],
        desired_replicas=replicas,
        ready_replicas=min(ready_routers, replicas),
        endpoint=endpoint,
        models=list(models),
    )


def model_status(
    *,
    gateway: str,
    verdict: ModelVerdict | None,
    generation: int,
    previous: InferenceModelStatus,
    now: str,
) -> InferenceModelStatus:
    """`verdict`: what the gateway made of the model; None when the gateway does not exist."""
    accepted: tuple[ConditionStatus, str, str]
    refs: tuple[ConditionStatus, str, str]
    if verdict is None:
        accepted = ("False", "GatewayNotFound", f"InferenceGateway {gateway} does not exist")
        refs = ("Unknown", "GatewayNotFound", "")
    else:
        accepted = (
            ("True", "Accepted", f"served by InferenceGateway {gateway}")
            if verdict.accepted
            else ("False", verdict.reason, verdict.message)
        )
        refs = (
            ("False", "TargetPoolMissing", verdict.message)
            if verdict.missing_pools
            else ("True", "ResolvedRefs", "")
        )
    before = previous.conditions
    return InferenceModelStatus(
        observed_generation=generation,
        conditions=[
            condition("Accepted", *accepted, before=before, now=now, generation=generation),
            condition("ResolvedRefs", *refs, before=before, now=now, generation=generation),
        ],
    )
