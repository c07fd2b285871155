"""One pool's reconcile and its children: what it creates, leaves alone, prunes and never
adopts, and how a bad spec, a refused child or a failing API server is reported (against
the fake API of testkit.pool_kube)."""

from __future__ import annotations

from typing import Any

import pytest
from testkit.pool_kube import SPEC, FakeKube, pool_body, reconciler

from kvflow.operator.kube import KubeError


def test_first_reconcile_creates_everything_and_writes_status(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    reconciler(kube, events).reconcile("ns", "p")
    assert len(kube.objects) == 9  # 7 + the workers' and the router's NetworkPolicies
    # ... and the pool's worker token Secret, created beside them (not applied).
    assert list(kube.secrets) == ["p-worker-token"]
    assert [e[1] for e in events] == ["Created"] * 10 + ["Ready"]
    assert kube.pool is not None and kube.pool["status"]["phase"] == "Ready"


def test_second_reconcile_changes_nothing(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    events.clear()
    patches = len(kube.status_patches)
    r.reconcile("ns", "p")
    assert events == []  # applied again, but nothing changed: no Events ...
    assert len(kube.status_patches) == patches  # ... and no status write


def test_mode_switch_prunes_the_old_role(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    kube.pool = pool_body({**SPEC, "mode": "disaggregated", "prefill": {}, "decode": {}}, 2)
    events.clear()
    r.reconcile("ns", "p")
    assert sorted(kube.deleted) == ["Deployment p-colocated", "PodDisruptionBudget p-colocated"]
    # A disaggregated pool's routers get the disaggregation policy in their config.
    assert "disaggregation:" in kube.objects[("ConfigMap", "p-router")]["data"]["router.yaml"]
    assert any("ConfigMap" in message for _, _, message in events)
    assert {k[1] for k in kube.objects if k[0] == "Deployment"} == {
        "p-prefill",
        "p-decode",
        "p-router",
    }


def test_a_bad_spec_touches_no_child_and_is_reported(events: list[Any]) -> None:
    spec = {**SPEC, "engine": {"extraArgs": ["--port", "1"]}}
    kube = FakeKube(pool_body(spec))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.applied == []
    assert kube.pool is not None and kube.pool["status"]["phase"] == "Degraded"
    assert events == [
        ("Warning", "Degraded", "Pool is Degraded: engine.extraArgs sets --port, "
         "which the operator sets from the spec"),
    ]  # fmt: skip


def test_a_child_the_api_server_refuses_is_reported_and_the_rest_applied(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    kube.reject["Deployment p-colocated"] = KubeError(
        422, 'Deployment.apps "p-colocated" is invalid'
    )
    reconciler(kube, events).reconcile("ns", "p")
    assert "Deployment p-router" in kube.applied
    assert kube.pool is not None
    degraded = next(c for c in kube.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyRejected"
    assert degraded["message"] == 'Deployment p-colocated: Deployment.apps "p-colocated" is invalid'


def test_a_child_the_operator_may_not_create_is_reported(events: list[Any]) -> None:
    """A 403 (the cluster's RBAC or an admission plugin: OpenShift's owner-reference
    enforcement refused blockOwnerDeletion) is the pool's status, not a reconcile that
    raises forever with the pool showing nothing."""
    kube = FakeKube(pool_body(SPEC))
    kube.reject["Deployment p-router"] = KubeError(
        403, 'deployments.apps "p-router" is forbidden: cannot set blockOwnerDeletion'
    )
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.pool is not None
    degraded = next(c for c in kube.pool["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyRejected" and "blockOwnerDeletion" in degraded["message"]


def test_a_transient_api_error_propagates_for_a_retry(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    kube.reject["Deployment p-router"] = KubeError(503, "unavailable")
    with pytest.raises(KubeError):
        reconciler(kube, events).reconcile("ns", "p")


def test_a_deleted_pool_is_left_to_garbage_collection(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    kube.pool = None
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.applied == [] and events == []


def test_children_of_another_pool_with_the_same_name_are_not_adopted(events: list[Any]) -> None:
    kube = FakeKube(pool_body(SPEC))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    for obj in kube.objects.values():  # leftovers of a deleted predecessor, being collected
        obj["metadata"]["ownerReferences"][0]["uid"] = "old-uid"
    events.clear()
    r.reconcile("ns", "p")
    assert [e[1] for e in events].count("Created") == 9  # treated as missing, not as ours
    assert kube.deleted == []  # and never deleted by us
