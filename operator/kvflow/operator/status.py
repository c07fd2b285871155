"""A pool's status from what the operator observed (pure; no clock, no client).

The handlers gather observations (the pool's Deployments, spec problems, apply errors) and
the current time; this module decides phase, conditions and replica counts. Conditions keep
their lastTransitionTime while their status does not change, so a status written every
drift tick does not look like a flapping pool.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_status import (
    Condition,
    ConditionStatus,
    PlannedReplicas,
    PlannerStatus,
    RoleStatus,
)
from kvflow.operator.builders.names import (
    PoolRef,
    WorkerRole,
    gateway_endpoint,
    router_name,
    worker_deployment_name,
    worker_roles,
)
from kvflow.operator.planner.types import Decision, SloVerdict

ProblemReason = Literal[
    "Unauthenticated", "HostPathNotAllowed", "PrometheusNotAllowed", "InvalidSpec", "ApplyRejected"
]


@dataclass(frozen=True)
class Problem:
    """Why the pool cannot be (fully) deployed; reported as Degraded, never raised."""

    reason: ProblemReason
    message: str


@dataclass(frozen=True)
class DeploymentObservation:
    """The parts of a Deployment's status that say whether its rollout is done."""

    ready_replicas: int
    updated_replicas: int
    generation: int
    observed_generation: int
    progress_deadline_exceeded: bool
    replicas: int = 0  # spec.replicas: what its scaler (spec, planner or external) asks for

    @staticmethod
    def from_object(obj: Mapping[str, Json]) -> DeploymentObservation:
        status = obj.get("status") or {}
        conditions = status.get("conditions") or []
        return DeploymentObservation(
            ready_replicas=int(status.get("readyReplicas") or 0),
            updated_replicas=int(status.get("updatedReplicas") or 0),
            generation=int(obj["metadata"].get("generation") or 0),
            observed_generation=int(status.get("observedGeneration") or 0),
            progress_deadline_exceeded=any(
                c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                for c in conditions
            ),
            replicas=int((obj.get("spec") or {}).get("replicas") or 0),
        )

    def is_rolled_out(self, desired: int) -> bool:
        return (
            self.observed_generation >= self.generation
            and self.updated_replicas >= desired
            and self.ready_replicas >= desired
        )


@dataclass(frozen=True)
class Serving:
    """Whether the gateway can answer with the workers that are ready now.

    `can_serve` False: every request gets a 503. `is_degraded`: requests are answered, but
    not the way the spec asks (no prefill worker: decode workers prefill every prompt).
    """

    can_serve: bool
    is_degraded: bool
    reason: str
    message: str


def judge_serving(mode: v1alpha1.Mode, roles: Sequence[RoleStatus]) -> Serving:
    """What the ready replicas of each role allow, from a client's point of view."""
    ready = {r.name: r.ready_replicas for r in roles}
    if mode == "disaggregated":
        if ready.get("decode", 0) == 0:
            # The gateway sends every request to a decode (or colocated) worker; a prefill
            # worker only computes prompts handed to it, so it cannot serve alone.
            return Serving(
                False, False, "NoDecodeWorkerReady",
                "no decode worker is ready, so the gateway cannot serve (prefill workers "
                "only compute prompts for decode workers)",
            )  # fmt: skip
        if ready.get("prefill", 0) == 0:
            return Serving(
                True, True, "NoPrefillWorkerReady",
                "no prefill worker is ready: decode workers prefill every prompt themselves",
            )  # fmt: skip
    elif ready.get("colocated", 0) == 0:
        return Serving(False, False, "NoWorkerReady", "no worker is ready to serve")
    if ready.get("router", 0) == 0:
        return Serving(False, False, "NoRouterReady", "no router is ready: the gateway is down")
    return Serving(True, False, "WorkersReady", "")


def compute_status(
    *,
    pool: PoolRef,
    spec: v1alpha1.InferencePoolSpec,
    deployments: Mapping[str, DeploymentObservation],
    problems: Sequence[Problem],
    previous: v1alpha1_status.InferencePoolStatus,
    now: str,
    replicas: Mapping[WorkerRole, int | None] | None = None,
) -> v1alpha1_status.InferencePoolStatus:
    """The status to write. `deployments` maps the names of the pool's observed Deployments;
    `replicas` what the operator applies per worker role (`builders.replicas`; None: an
    external autoscaler's role, whose Deployment says how many). Unset: spec.replicas."""
    applied = replicas or {}
    expected: list[tuple[v1alpha1_status.RoleName, str, int]] = []
    for role, rs in worker_roles(spec):
        name = worker_deployment_name(pool, role)
        wanted = applied.get(role, rs.replicas)
        if wanted is None:
            wanted = deployments[name].replicas if name in deployments else rs.replicas
        expected.append((role, name, wanted))
    expected.append(("router", router_name(pool), spec.router.replicas))
    roles = [
        RoleStatus(
            name=role,
            desired_replicas=desired,
            ready_replicas=deployments[name].ready_replicas if name in deployments else 0,
            updated_replicas=deployments[name].updated_replicas if name in deployments else 0,
        )
        for role, name, desired in expected
    ]
    missing = [name for _, name, _ in expected if name not in deployments]
    pending = [
        name
        for _, name, desired in expected
        if name in deployments and not deployments[name].is_rolled_out(desired)
    ]
    stuck = sorted(n for n, d in deployments.items() if d.progress_deadline_exceeded)
    workers = [r for r in roles if r.name != "router"]
    desired_workers = sum(r.desired_replicas for r in workers)
    ready_workers = sum(min(r.ready_replicas, r.desired_replicas) for r in workers)
    serving = judge_serving(spec.mode, roles)
    summary = _summary(roles)
    if serving.message:
        summary = f"{summary}; {serving.message}"

    ready: tuple[ConditionStatus, str, str]
    progressing: tuple[ConditionStatus, str, str]
    degraded: tuple[ConditionStatus, str, str]
    if problems:
        text = "; ".join(p.message for p in problems)
        ready = ("False", problems[0].reason, text)
        progressing = ("False", problems[0].reason, "fix the spec to continue")
        degraded = ("True", problems[0].reason, text)
    elif missing:
        ready = ("False", "Creating", f"waiting for {', '.join(missing)}")
        progressing = ("True", "Creating", f"creating {', '.join(missing)}")
        degraded = ("False", "AsExpected", "")
    else:
        # Ready says whether the pool serves as asked; a pool that cannot serve at all says
        # why in Ready's reason. Degraded flags what needs a person: a stuck rollout, or a
        # settled pool that cannot serve or serves without its prefill workers.
        if not serving.can_serve:
            ready = ("False", serving.reason, summary)
        elif pending:
            ready = ("False", "ReplicasNotReady", summary)
        else:
            ready = ("True", "AllReplicasReady", summary)
        if pending:
            progressing = ("True", "RollingOut", f"rolling out {', '.join(pending)}")
        else:
            progressing = ("False", "RolloutComplete", "")
        if stuck:
            degraded = ("True", "RolloutStuck", f"progress deadline exceeded: {', '.join(stuck)}")
        elif not pending and (serving.is_degraded or not serving.can_serve):
            degraded = ("True", serving.reason, serving.message)
        else:
            degraded = ("False", "AsExpected", "")

    generation = pool.generation
    conditions = [
        _condition("Ready", *ready, previous=previous, now=now, generation=generation),
        _condition("Progressing", *progressing, previous=previous, now=now, generation=generation),
        _condition("Degraded", *degraded, previous=previous, now=now, generation=generation),
        _slo_condition(spec, previous, now, generation),
    ]
    if degraded[0] == "True":
        phase: v1alpha1_status.Phase = "Degraded"
    elif ready[0] == "True":
        phase = "Ready"
    elif len(missing) == len(expected):
        phase = "Pending"
    else:
        phase = "Progressing"
    return v1alpha1_status.InferencePoolStatus(
        phase=phase,
        observed_generation=generation,
        conditions=conditions,
        roles=roles,
        desired_replicas=desired_workers,
        ready_replicas=ready_workers,
        gateway_endpoint=gateway_endpoint(pool, spec.router.port),
        # Autoscaling off: the planner's replicas are void (re-enabled, it starts from the
        # spec's, not from a stale decision).
        planner=previous.planner
        if spec.autoscaling.enabled
        else replace(previous.planner, roles=[]),
    )


def _summary(roles: Sequence[RoleStatus]) -> str:
    return ", ".join(f"{r.name} {r.ready_replicas}/{r.desired_replicas} ready" for r in roles)


def _previous(previous: v1alpha1_status.InferencePoolStatus, type_: str) -> Condition | None:
    return next((c for c in previous.conditions if c.type == type_), None)


def _condition(
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    previous: v1alpha1_status.InferencePoolStatus,
    now: str,
    generation: int,
) -> Condition:
    before = _previous(previous, type_)
    unchanged = before is not None and before.status == status and before.last_transition_time
    return Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=before.last_transition_time if unchanged and before else now,
        observed_generation=generation,
    )


def _slo_condition(
    spec: v1alpha1.InferencePoolSpec,
    previous: v1alpha1_status.InferencePoolStatus,
    now: str,
    generation: int,
) -> Condition:
    """SLOMet belongs to the planner; until it has judged, say why it is Unknown."""
    if not spec.autoscaling.enabled:
        return _condition(
            "SLOMet",
            "Unknown",
            "AutoscalingDisabled",
            "the planner judges the SLO when autoscaling is enabled",
            previous=previous,
            now=now,
            generation=generation,
        )
    before = _previous(previous, "SLOMet")
    if (
        before is not None
        and previous.planner.decided_at
        and before.reason != "AutoscalingDisabled"
    ):
        return before  # the planner's own verdict (the planner has run: decidedAt is set)
    return _condition(
        "SLOMet",
        "Unknown",
        "AwaitingMetrics",
        "the planner has not measured TTFT and TPOT yet",
        previous=previous,
        now=now,
        generation=generation,
    )


def unreadable_status(
    problem: Problem, previous: v1alpha1_status.InferencePoolStatus, generation: int, now: str
) -> v1alpha1_status.InferencePoolStatus:
    """Status of a pool whose spec cannot even be read (a CRD older than the operator)."""
    return v1alpha1_status.InferencePoolStatus(
        phase="Degraded",
        observed_generation=generation,
        conditions=[
            _condition(
                "Ready",
                "False",
                problem.reason,
                problem.message,
                previous=previous,
                now=now,
                generation=generation,
            ),
            _condition(
                "Degraded",
                "True",
                problem.reason,
                problem.message,
                previous=previous,
                now=now,
                generation=generation,
            ),
        ],
        roles=previous.roles,
        desired_replicas=previous.desired_replicas,
        ready_replicas=previous.ready_replicas,
        gateway_endpoint=previous.gateway_endpoint,
        planner=previous.planner,
    )


def with_plan(
    previous: v1alpha1_status.InferencePoolStatus,
    *,
    decisions: Sequence[Decision],
    scaled_roles: Collection[str],
    slo: SloVerdict,
    now: str,
    generation: int,
) -> v1alpha1_status.InferencePoolStatus:
    """The status after one planner interval: its replicas per role (what reconcile then
    applies), the decision and reason, and SLOMet, of which the planner is the only writer.
    `scaled_roles`: the roles the planner moves now (not pinned, not an external
    autoscaler's); earlier decisions for other roles are dropped."""
    planned = {p.name: p.replicas for p in previous.planner.roles if p.name in scaled_roles}
    planned.update({d.role: d.replicas for d in decisions})
    summary = ", ".join(
        f"{d.role} {d.previous_replicas}->{d.replicas}" if d.is_change else f"{d.role} {d.replicas}"
        for d in decisions
    )
    reason = "; ".join(f"{d.role}: {d.reason}: {d.message}" for d in decisions)
    planner = PlannerStatus(
        roles=[PlannedReplicas(name=name, replicas=n) for name, n in sorted(planned.items())],
        last_decision=summary,
        reason=reason[:1024],
        decided_at=now,
    )
    slo_condition = _condition(
        "SLOMet", slo.status, slo.reason, slo.message,
        previous=previous, now=now, generation=generation,
    )  # fmt: skip
    conditions = [c for c in previous.conditions if c.type != "SLOMet"] + [slo_condition]
    return replace(previous, planner=planner, conditions=conditions)
