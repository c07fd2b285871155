"""Who owns a role's replicas, and what the builders apply (pure)."""

from __future__ import annotations

from typing import Any

from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import ChildKey, desired_children
from kvflow.operator.builders.names import Images, PoolRef
from kvflow.operator.builders.replicas import (
    HANDOVER_MANAGER,
    applied_replicas,
    handover_patch,
    needs_handover,
    owns_replicas,
    planned_replicas,
)

POOL = PoolRef(name="p", namespace="ns", uid="uid-1")
IMAGES = Images(worker="w", router="r")


def spec_of(**overrides: Any) -> v1alpha1.InferencePoolSpec:
    data: dict[str, Any] = {
        "model": {"servedName": "m"},
        "mode": "disaggregated",
        "prefill": {"replicas": 2, "maxReplicas": 6},
        "decode": {"replicas": 3, "maxReplicas": 6},
    }
    data.update(overrides)
    return from_json(v1alpha1.InferencePoolSpec, data)


def deployment_specs(
    spec: v1alpha1.InferencePoolSpec, planned: dict[str, int]
) -> dict[str, dict[str, Any]]:
    children = desired_children(POOL, spec, IMAGES, applied_replicas(spec, planned))
    return {ChildKey.of(o).name: o["spec"] for o in children if ChildKey.of(o).kind == "Deployment"}


def test_autoscaling_off_applies_the_spec_and_ignores_old_decisions() -> None:
    specs = deployment_specs(spec_of(), {"decode": 5})
    assert (specs["p-prefill"]["replicas"], specs["p-decode"]["replicas"]) == (2, 3)


def test_autoscaling_on_applies_the_planners_decision_within_bounds() -> None:
    spec = spec_of(autoscaling={"enabled": True})
    assert applied_replicas(spec, {}) == {"prefill": 2, "decode": 3}  # no decision yet
    assert applied_replicas(spec, {"decode": 5}) == {"prefill": 2, "decode": 5}
    assert applied_replicas(spec, {"decode": 40, "prefill": 0}) == {"prefill": 0, "decode": 6}
    assert deployment_specs(spec, {"decode": 5})["p-decode"]["replicas"] == 5
    # The manual override wins at once, before the planner's next interval.
    pinned = spec_of(autoscaling={"enabled": True, "manualRoles": ["decode"]})
    assert applied_replicas(pinned, {"decode": 5, "prefill": 4}) == {"prefill": 4, "decode": 3}


def test_an_external_autoscalers_role_carries_no_replicas() -> None:
    spec = spec_of(
        autoscaling={"enabled": True},
        decode={"replicas": 3, "externalAutoscaler": True},
    )
    assert applied_replicas(spec, {"decode": 5, "prefill": 4}) == {"prefill": 4, "decode": None}
    specs = deployment_specs(spec, {"decode": 5})
    assert "replicas" not in specs["p-decode"]
    assert specs["p-prefill"]["replicas"] == 2
    # Everything else of the Deployment is still applied.
    assert specs["p-decode"]["template"]["spec"]["containers"][0]["name"] == "worker"
    # The router's replicas are the spec's in every case.
    assert deployment_specs(spec, {})["p-router"]["replicas"] == 1


def test_planned_replicas_read_from_status() -> None:
    status = from_json(
        v1alpha1_status.InferencePoolStatus,
        {"planner": {"roles": [{"name": "decode", "replicas": 4}]}},
    )
    assert planned_replicas(status) == {"decode": 4}
    assert planned_replicas(v1alpha1_status.InferencePoolStatus()) == {}


def managed(*entries: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "metadata": {
            "managedFields": [
                {"manager": m, "operation": op, "fieldsV1": {"f:spec": fields}}
                for m, op, fields in entries
            ]
        }
    }


def test_replica_ownership_from_managed_fields() -> None:
    ours = managed(("kvflow-operator", "Apply", {"f:replicas": {}, "f:selector": {}}))
    theirs = managed(
        ("kvflow-operator", "Apply", {"f:selector": {}}),
        ("kube-controller-manager", "Update", {"f:replicas": {}}),
    )
    assert owns_replicas(ours, "kvflow-operator")
    assert not owns_replicas(theirs, "kvflow-operator")
    assert not owns_replicas(managed(), "kvflow-operator")
    assert needs_handover(None, "kvflow-operator")  # about to be created by us
    assert needs_handover(ours, "kvflow-operator")
    assert not needs_handover(theirs, "kvflow-operator")


def test_handover_patch_names_only_the_replicas() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "p-decode", "namespace": "ns", "labels": {"a": "b"}},
        "spec": {"selector": {}},
    }
    assert handover_patch(deployment, 4) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "p-decode", "namespace": "ns"},
        "spec": {"replicas": 4},
    }
    assert HANDOVER_MANAGER != "kvflow-operator"
