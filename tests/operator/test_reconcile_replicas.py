"""Who sets a role's replicas through the reconcile: the spec, an external autoscaler (the
handover of the field and back) or the planner's decision written to status, and a status
refresh that claims no generation it did not apply (against testkit.pool_kube's fake API)."""

from __future__ import annotations

from typing import Any

from testkit.pool_kube import SPEC, FakeKube, pool_body, reconciler

from kvflow.operator.kube import FIELD_MANAGER


def deployment_replicas(kube: FakeKube, name: str) -> int:
    replicas: int = kube.objects[("Deployment", name)]["spec"]["replicas"]
    return replicas


def test_an_externally_scaled_role_is_created_with_its_replicas_then_left_alone(
    events: list[Any],
) -> None:
    spec = {**SPEC, "colocated": {"replicas": 3, "externalAutoscaler": True}}
    kube = FakeKube(pool_body(spec))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 3  # seeded from the spec
    assert FIELD_MANAGER not in kube.replica_owners[("Deployment", "p-colocated")]
    kube.scale("p-colocated", 6)  # the HPA
    r.reconcile("ns", "p")
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 6
    assert kube.pool is not None
    (colocated,) = [x for x in kube.pool["status"]["roles"] if x["name"] == "colocated"]
    assert colocated["desiredReplicas"] == 6  # status reports what the autoscaler asks


def test_handing_a_role_to_an_external_autoscaler_keeps_its_replicas(events: list[Any]) -> None:
    kube = FakeKube(pool_body({**SPEC, "colocated": {"replicas": 3}}))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    assert kube.replica_owners[("Deployment", "p-colocated")] == {FIELD_MANAGER}
    kube.pool = pool_body({**SPEC, "colocated": {"replicas": 3, "externalAutoscaler": True}}, 2)
    r.reconcile("ns", "p")
    # Dropping a field we alone owned would reset it to 1: it is handed over first.
    assert deployment_replicas(kube, "p-colocated") == 3
    kube.scale("p-colocated", 5)
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 5
    kube.pool = pool_body({**SPEC, "colocated": {"replicas": 2}}, 3)  # taken back
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 2


def test_an_autoscaler_scaling_during_the_handover_keeps_its_count(events: list[Any]) -> None:
    kube = FakeKube(pool_body({**SPEC, "colocated": {"replicas": 3}}))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    kube.pool = pool_body({**SPEC, "colocated": {"replicas": 3, "externalAutoscaler": True}}, 2)

    def hpa_scales(kind: str) -> None:  # between the operator's read and its handover
        if kind == "Deployment" and deployment_replicas(kube, "p-colocated") == 3:
            kube.scale("p-colocated", 2)

    kube.after_list = hpa_scales
    r.reconcile("ns", "p")
    # The handover would have put back the 3 it read; unforced, the HPA's 2 stands.
    assert deployment_replicas(kube, "p-colocated") == 2
    assert kube.replica_owners[("Deployment", "p-colocated")] == {"hpa"}


def test_a_status_refresh_claims_no_generation_it_did_not_apply(events: list[Any]) -> None:
    kube = FakeKube(pool_body({**SPEC, "colocated": {"replicas": 3}}))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    kube.pool = {
        **pool_body({**SPEC, "colocated": {"replicas": 4}}, 2),
        "status": kube.pool["status"],
    }
    r.reconcile("ns", "p", apply=False)  # a Deployment event before the pool's own
    assert deployment_replicas(kube, "p-colocated") == 3
    status = kube.pool["status"]
    assert status["observedGeneration"] == 1  # generation 2 is not applied yet
    assert {c["observedGeneration"] for c in status["conditions"]} == {1}
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 4
    assert kube.pool["status"]["observedGeneration"] == 2


def test_with_autoscaling_the_planners_decision_is_applied_and_kept(events: list[Any]) -> None:
    spec = {**SPEC, "autoscaling": {"enabled": True}, "colocated": {"replicas": 1}}
    kube = FakeKube(pool_body(spec))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 1  # before any decision: the spec
    assert kube.pool is not None
    kube.pool["status"]["planner"]["roles"] = [{"name": "colocated", "replicas": 4}]
    r.reconcile("ns", "p")
    r.reconcile("ns", "p")  # a drift sweep does not undo it
    assert deployment_replicas(kube, "p-colocated") == 4
    assert kube.pool["status"]["desiredReplicas"] == 4
    kube.pool["spec"]["autoscaling"]["enabled"] = False  # off: the spec's count again
    r.reconcile("ns", "p")
    assert deployment_replicas(kube, "p-colocated") == 1


def test_a_plan_is_written_to_status_then_applied(events: list[Any]) -> None:
    from kvflow.operator.planner.types import Decision, SloVerdict
    from kvflow.operator.reconcile import PlanOutcome

    spec = {**SPEC, "autoscaling": {"enabled": True}, "colocated": {"replicas": 1}}
    kube = FakeKube(pool_body(spec))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    outcome = PlanOutcome(
        decisions=(Decision("colocated", 3, 1, "TpotViolation", "p90 TPOT 0.2 s > 0.1 s"),),
        scaled_roles=("colocated",),
        slo=SloVerdict("False", "TpotAboveTarget", "p90 TPOT 0.2 s > 0.1 s"),
    )
    seen: list[str] = []

    def decide(body: dict[str, Any]) -> PlanOutcome:
        seen.append(body["metadata"]["name"])
        return outcome

    assert r.record_plan("ns", "p", decide) == outcome
    assert seen == ["p"]
    assert deployment_replicas(kube, "p-colocated") == 3
    assert kube.pool is not None
    status = kube.pool["status"]
    assert status["planner"]["roles"] == [{"name": "colocated", "replicas": 3}]
    assert status["planner"]["lastDecision"] == "colocated 1->3"
    slo = next(c for c in status["conditions"] if c["type"] == "SLOMet")
    assert (slo["status"], slo["reason"]) == ("False", "TpotAboveTarget")
    assert status["desiredReplicas"] == 3
    # A declined interval (autoscaling just turned off, say) writes nothing.
    patches = len(kube.status_patches)
    assert r.record_plan("ns", "p", lambda body: None) is None
    assert len(kube.status_patches) == patches
