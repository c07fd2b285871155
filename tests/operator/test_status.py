"""Pool status from observations (pure): phase, conditions, counts, transitions."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api.schema import from_json
from kvflow.operator.api.v1alpha1_status import RoleStatus
from kvflow.operator.builders.names import PoolRef
from kvflow.operator.status import (
    DeploymentObservation,
    Problem,
    compute_status,
    judge_serving,
    unreadable_status,
)

POOL = PoolRef(name="p", namespace="ns", uid="u", generation=4)
SPEC = from_json(
    v1alpha1.InferencePoolSpec, {"model": {"servedName": "m"}, "colocated": {"replicas": 2}}
)
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def observed(
    ready: int, updated: int | None = None, stuck: bool = False, behind: bool = False
) -> DeploymentObservation:
    return DeploymentObservation(
        ready_replicas=ready,
        updated_replicas=ready if updated is None else updated,
        generation=2,
        observed_generation=1 if behind else 2,
        progress_deadline_exceeded=stuck,
    )


def status_of(
    deployments: dict[str, DeploymentObservation],
    problems: list[Problem] | None = None,
    previous: v1alpha1_status.InferencePoolStatus | None = None,
    now: str = T0,
    spec: v1alpha1.InferencePoolSpec = SPEC,
) -> v1alpha1_status.InferencePoolStatus:
    return compute_status(
        pool=POOL,
        spec=spec,
        deployments=deployments,
        problems=problems or [],
        previous=previous or v1alpha1_status.InferencePoolStatus(),
        now=now,
    )


def conditions(status: v1alpha1_status.InferencePoolStatus) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}


READY = {"p-colocated": observed(2), "p-router": observed(1)}


@pytest.mark.parametrize(
    ("deployments", "phase", "expected"),
    [
        (
            {},
            "Pending",
            ("False Creating", "True Creating", "False AsExpected"),
        ),
        (
            {"p-colocated": observed(2)},
            "Progressing",
            ("False Creating", "True Creating", "False AsExpected"),
        ),
        (
            {"p-colocated": observed(1), "p-router": observed(1)},
            "Progressing",
            ("False ReplicasNotReady", "True RollingOut", "False AsExpected"),
        ),
        (
            {"p-colocated": observed(2, updated=1), "p-router": observed(1)},
            "Progressing",
            ("False ReplicasNotReady", "True RollingOut", "False AsExpected"),
        ),
        (
            {"p-colocated": observed(2, behind=True), "p-router": observed(1)},
            "Progressing",
            ("False ReplicasNotReady", "True RollingOut", "False AsExpected"),
        ),
        (
            {"p-colocated": observed(0, stuck=True), "p-router": observed(1)},
            "Degraded",
            ("False NoWorkerReady", "True RollingOut", "True RolloutStuck"),
        ),
        (
            READY,
            "Ready",
            ("True AllReplicasReady", "False RolloutComplete", "False AsExpected"),
        ),
    ],
)  # fmt: skip
def test_phase_and_conditions(
    deployments: dict[str, DeploymentObservation], phase: str, expected: tuple[str, str, str]
) -> None:
    """expected: "status reason" of Ready, Progressing and Degraded."""
    status = status_of(deployments)
    assert status.phase == phase
    got = conditions(status)
    assert tuple(" ".join(got[k]) for k in ("Ready", "Progressing", "Degraded")) == expected
    assert got["SLOMet"] == ("Unknown", "AutoscalingDisabled")
    assert status.observed_generation == 4


def test_counts_and_endpoint() -> None:
    status = status_of({"p-colocated": observed(3), "p-router": observed(1)})
    assert status.desired_replicas == 2
    assert status.ready_replicas == 2  # surplus pods during a rollout do not count twice
    assert [(r.name, r.desired_replicas, r.ready_replicas) for r in status.roles] == [
        ("colocated", 2, 3),
        ("router", 1, 1),
    ]
    assert status.gateway_endpoint == "http://p-gateway.ns.svc/v1"
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.message == "colocated 3/2 ready, router 1/1 ready"


def test_problems_make_the_pool_degraded_with_their_reason_and_messages() -> None:
    problems = [Problem("InvalidSpec", "a is wrong"), Problem("InvalidSpec", "b is wrong")]
    status = status_of(READY, problems=problems)
    assert status.phase == "Degraded"
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason, degraded.message) == (
        "True", "InvalidSpec", "a is wrong; b is wrong",
    )  # fmt: skip


def test_transition_time_moves_only_when_the_status_changes() -> None:
    first = status_of({"p-colocated": observed(1), "p-router": observed(1)}, now=T0)
    again = status_of({"p-colocated": observed(1), "p-router": observed(1)}, previous=first, now=T1)
    assert [c.last_transition_time for c in again.conditions] == [T0, T0, T0, T0]
    ready = status_of(READY, previous=again, now=T1)
    times = {c.type: c.last_transition_time for c in ready.conditions}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0, "SLOMet": T0}


def test_slo_condition_is_the_planners_once_it_has_judged() -> None:
    spec = from_json(
        v1alpha1.InferencePoolSpec,
        {
            "model": {"servedName": "m"},
            "colocated": {"replicas": 2},
            "autoscaling": {"enabled": True},
        },
    )
    awaiting = status_of(READY, spec=spec)
    assert conditions(awaiting)["SLOMet"] == ("Unknown", "AwaitingMetrics")
    verdict = v1alpha1_status.Condition(
        "SLOMet", "False", "TTFTAboveTarget", "p90 TTFT 1.4 s > 1 s", T0, 4
    )
    planner = v1alpha1_status.PlannerStatus(
        roles=[v1alpha1_status.PlannedReplicas("colocated", 3)],
        last_decision="colocated 2->3",
        reason="TTFT above target",
        decided_at=T0,
    )
    previous = v1alpha1_status.InferencePoolStatus(conditions=[verdict], planner=planner)
    status = status_of(READY, previous=previous, now=T1, spec=spec)
    assert next(c for c in status.conditions if c.type == "SLOMet") == verdict
    assert status.planner == planner


def test_unreadable_spec_keeps_the_last_counts() -> None:
    previous = status_of(READY)
    status = unreadable_status(Problem("InvalidSpec", "spec.x: bad"), previous, 5, T1)
    assert status.phase == "Degraded" and status.observed_generation == 5
    assert status.ready_replicas == 2
    assert conditions(status) == {
        "Ready": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }


def disaggregated(prefill: int, decode: int, wanted: tuple[int, int] = (1, 2)) -> dict[str, Any]:
    """Status of a disaggregated pool with `prefill` and `decode` ready workers, where the
    spec asks for `wanted` (prefill, decode) and every Deployment has rolled out its pods."""
    spec = from_json(
        v1alpha1.InferencePoolSpec,
        {
            "model": {"servedName": "m"},
            "mode": "disaggregated",
            "prefill": {"replicas": wanted[0], "minReplicas": 0},
            "decode": {"replicas": wanted[1], "minReplicas": 0},
        },
    )
    status = status_of(
        {
            "p-prefill": observed(prefill, updated=wanted[0]),
            "p-decode": observed(decode, updated=wanted[1]),
            "p-router": observed(1),
        },
        spec=spec,
    )
    return {
        "phase": status.phase,
        **{c.type: (c.status, c.reason, c.message) for c in status.conditions},
    }


NO_DECODE = (
    "no decode worker is ready, so the gateway cannot serve (prefill workers only compute "
    "prompts for decode workers)"
)
NO_PREFILL = "no prefill worker is ready: decode workers prefill every prompt themselves"


def test_disaggregated_pool_without_a_ready_decode_worker_cannot_serve() -> None:
    rolling = disaggregated(prefill=1, decode=0)
    assert rolling["phase"] == "Progressing"
    assert rolling["Ready"] == (
        "False",
        "NoDecodeWorkerReady",
        f"prefill 1/1 ready, decode 0/2 ready, router 1/1 ready; {NO_DECODE}",
    )
    assert rolling["Degraded"][:2] == ("False", "AsExpected")  # pods are still coming up

    # Settled with no decode worker asked for: nothing will change, so a person must act.
    settled = disaggregated(prefill=1, decode=0, wanted=(1, 0))
    assert settled["phase"] == "Degraded"
    assert settled["Ready"][:2] == ("False", "NoDecodeWorkerReady")
    assert settled["Degraded"] == ("True", "NoDecodeWorkerReady", NO_DECODE)


def test_disaggregated_pool_without_a_ready_prefill_worker_serves_degraded() -> None:
    rolling = disaggregated(prefill=0, decode=2)
    assert rolling["phase"] == "Progressing"
    assert rolling["Ready"] == (
        "False",
        "ReplicasNotReady",
        f"prefill 0/1 ready, decode 2/2 ready, router 1/1 ready; {NO_PREFILL}",
    )

    settled = disaggregated(prefill=0, decode=2, wanted=(0, 2))
    assert settled["phase"] == "Degraded"
    assert settled["Ready"][:2] == ("True", "AllReplicasReady")  # it serves ...
    assert settled["Degraded"] == ("True", "NoPrefillWorkerReady", NO_PREFILL)  # ... degraded


def test_disaggregated_pool_with_both_roles_ready_is_ready() -> None:
    status = disaggregated(prefill=1, decode=2)
    assert status["phase"] == "Ready"
    assert status["Ready"] == (
        "True",
        "AllReplicasReady",
        "prefill 1/1 ready, decode 2/2 ready, router 1/1 ready",
    )
    assert status["Degraded"][:2] == ("False", "AsExpected")


def test_pool_without_a_ready_router_cannot_serve() -> None:
    status = status_of({"p-colocated": observed(2), "p-router": observed(0, updated=1)})
    assert conditions(status)["Ready"] == ("False", "NoRouterReady")


@pytest.mark.parametrize(
    ("ready", "serving"),
    [
        ({"colocated": 0, "router": 1}, (False, False, "NoWorkerReady")),
        ({"colocated": 1, "router": 0}, (False, False, "NoRouterReady")),
        ({"colocated": 1, "router": 1}, (True, False, "WorkersReady")),
    ],
)
def test_judge_serving_colocated(ready: dict[str, int], serving: tuple[bool, bool, str]) -> None:
    roles = [RoleStatus(name, 1, n, 1) for name, n in ready.items()]  # type: ignore[arg-type]
    got = judge_serving("colocated", roles)
    assert (got.can_serve, got.is_degraded, got.reason) == serving


def test_judge_serving_disaggregated_needs_decode_not_prefill() -> None:
    def judge(prefill: int, decode: int) -> tuple[bool, bool, str]:
        roles = [
            RoleStatus("prefill", 1, prefill, 1),
            RoleStatus("decode", 1, decode, 1),
            RoleStatus("router", 1, 1, 1),
        ]
        got = judge_serving("disaggregated", roles)
        return got.can_serve, got.is_degraded, got.reason

    assert judge(prefill=1, decode=0) == (False, False, "NoDecodeWorkerReady")
    assert judge(prefill=0, decode=0) == (False, False, "NoDecodeWorkerReady")
    assert judge(prefill=0, decode=1) == (True, True, "NoPrefillWorkerReady")
    assert judge(prefill=1, decode=1) == (True, False, "WorkersReady")


def test_the_planners_interval_writes_replicas_reason_and_slo() -> None:
    from kvflow.operator.planner.types import Decision, SloVerdict
    from kvflow.operator.status import with_plan

    spec = from_json(
        v1alpha1.InferencePoolSpec,
        {"model": {"servedName": "m"}, "autoscaling": {"enabled": True}},
    )
    before = status_of(READY, spec=spec)
    after = with_plan(
        before,
        decisions=[Decision("colocated", 3, 2, "TtftViolation", "p90 TTFT 1.4 s > 1 s")],
        scaled_roles=["colocated"],
        slo=SloVerdict("False", "TtftAboveTarget", "p90 TTFT 1.4 s > 1 s"),
        now=T1,
        generation=4,
    )
    assert after.planner.roles == [v1alpha1_status.PlannedReplicas("colocated", 3)]
    assert after.planner.last_decision == "colocated 2->3"
    assert after.planner.reason == "colocated: TtftViolation: p90 TTFT 1.4 s > 1 s"
    assert conditions(after)["SLOMet"] == ("False", "TtftAboveTarget")
    assert [c.type for c in after.conditions] == [c.type for c in before.conditions]
    # The next reconcile keeps the planner's verdict and replicas.
    again = status_of(READY, previous=after, now=T1, spec=spec)
    assert conditions(again)["SLOMet"] == ("False", "TtftAboveTarget")
    assert again.planner == after.planner

    # A role the planner no longer moves (pinned, or handed to an HPA) loses its decision.
    pinned = with_plan(
        after,
        decisions=[],
        scaled_roles=[],
        slo=SloVerdict("True", "WithinTargets", ""),
        now=T1,
        generation=4,
    )
    assert pinned.planner.roles == []
    # And autoscaling off voids the planner's replicas.
    off = status_of(READY, previous=after, now=T1, spec=SPEC)
    assert off.planner.roles == []
