"""Who owns each worker role's replica count, and what the operator applies (pure).

Three owners, one per role:

- `spec`: autoscaling off. The operator applies `spec.<role>.replicas` on every reconcile,
  so a hand edit of the Deployment's replicas is put back (drift).
- `planner`: autoscaling on. The operator applies the planner's last decision, kept in
  `status.planner.roles`; before the first decision, `spec.<role>.replicas`. A role named
  in `autoscaling.manualRoles` (the manual override) is the spec's again at once.
- `external`: `spec.<role>.externalAutoscaler`. An HPA, KEDA or a person scales the
  Deployment; the operator leaves `replicas` out of what it applies, so server-side apply
  gives it no owner on our side and never resets it.

Leaving a field out of an apply *removes* it when our field manager was its only owner
(a Deployment's replicas would then default to 1). `needs_handover` tells when the
operator must first hand the field to a second manager before dropping it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from kvflow.operator.api import v1alpha1, v1alpha1_status, v1alpha1_workers
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import WorkerRole, worker_roles

ReplicaOwner = Literal["spec", "planner", "external"]

# The manager that holds `spec.replicas` of an externally scaled Deployment after the
# operator lets go of it (the "handover" of Kubernetes' server-side apply docs). It never
# writes again; the autoscaler's first change takes the field over from it.
HANDOVER_MANAGER = "kvflow-operator-handover"


def replica_owner(
    spec: v1alpha1.InferencePoolSpec, role: WorkerRole, role_spec: v1alpha1_workers.RoleSpec
) -> ReplicaOwner:
    if role_spec.external_autoscaler:
        return "external"
    if spec.autoscaling.enabled and role not in spec.autoscaling.manual_roles:
        return "planner"
    return "spec"  # autoscaling off, or the role pinned by the manual override


def planned_replicas(status: v1alpha1_status.InferencePoolStatus) -> dict[str, int]:
    """The planner's last decision per role, as persisted in the pool's status."""
    return {p.name: p.replicas for p in status.planner.roles}


def applied_replicas(
    spec: v1alpha1.InferencePoolSpec, planned: Mapping[str, int]
) -> dict[WorkerRole, int | None]:
    """Replicas to apply per worker role; None: leave the field out (external owner)."""
    out: dict[WorkerRole, int | None] = {}
    for role, role_spec in worker_roles(spec):
        owner = replica_owner(spec, role, role_spec)
        if owner == "external":
            out[role] = None
        elif owner == "planner" and role in planned:
            # Bounds may have moved since the decision; they win until the next one.
            out[role] = min(max(planned[role], role_spec.min_replicas), role_spec.max_replicas)
        else:
            out[role] = role_spec.replicas
    return out


def owns_replicas(obj: Mapping[str, Json], manager: str) -> bool:
    """Does `manager` hold `spec.replicas` of `obj` through server-side apply?"""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") != manager or entry.get("operation") != "Apply":
            continue
        fields = entry.get("fieldsV1") or {}
        if "f:replicas" in (fields.get("f:spec") or {}):
            return True
    return False


def needs_handover(observed: Mapping[str, Json] | None, manager: str) -> bool:
    """An externally scaled Deployment whose replicas the operator still owns (it was
    operator-scaled until now, or the operator just created it): dropping the field from
    the apply would reset it, so it must be handed over first."""
    return observed is None or owns_replicas(observed, manager)


def handover_patch(deployment: Mapping[str, Json], replicas: int) -> dict[str, Json]:
    """The apply body of the handover manager: only the replica count, as it is now."""
    meta = deployment["metadata"]
    return {
        "apiVersion": deployment["apiVersion"],
        "kind": deployment["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }
