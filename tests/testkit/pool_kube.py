"""A fake Kubernetes API holding one InferencePool and its children, and a Reconciler wired
to it, for the pool reconcile tests (tests/operator/test_reconcile*.py). The reconcile is
the only part tested with a fake: its I/O is the point, and the real API server tests in
tests/k8s cover the same flows end to end."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from kvflow.operator.admin_policy import AdminPolicy
from kvflow.operator.builders.desired import ChildKey
from kvflow.operator.builders.names import Images
from kvflow.operator.kube import FIELD_MANAGER, KubeError
from kvflow.operator.reconcile import Reconciler

NOW = "2026-01-01T00:00:00Z"


class FakeKube:
    """Keeps objects by (kind, name); generation bumps when the spec (or data) changes."""

    def __init__(self, pool: dict[str, Any]) -> None:
        self.pool: dict[str, Any] | None = pool
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.applied: list[str] = []
        self.deleted: list[str] = []
        self.status_patches: list[dict[str, Any]] = []
        self.reject: dict[str, KubeError] = {}  # "Kind name" -> the error apply raises
        self.replica_owners: dict[tuple[str, str], set[str]] = {}
        self.after_list: Callable[[str], None] | None = None
        self.secrets: dict[str, dict[str, Any]] = {}  # created Secrets by name
        self.secret_creates = 0

    def create_secret(self, secret: dict[str, Any]) -> bool:
        """Create, never update: an existing Secret is left as it is (HTTP 409)."""
        self.secret_creates += 1
        name = secret["metadata"]["name"]
        if name in self.secrets:
            return False
        self.secrets[name] = copy.deepcopy(secret)
        return True

    def scale(self, name: str, replicas: int, manager: str = "hpa") -> None:
        """What an HPA does: an update of the scale subresource takes the field over."""
        stored = self.objects[("Deployment", name)]
        stored["spec"]["replicas"] = replicas
        self.replica_owners[("Deployment", name)] = {manager}
        _record_owners(stored, {manager})

    def get_pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pool)

    def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        assert self.pool is not None
        self.status_patches.append(status)
        self.pool["status"] = copy.deepcopy(status)

    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Any]:
        listed = [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind]
        if self.after_list is not None:
            self.after_list(kind)  # something changes the objects after the reconcile read
        return listed

    def apply(
        self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, *, force: bool = True
    ) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["name"])
        if f"{key[0]} {key[1]}" in self.reject:
            raise self.reject[f"{key[0]} {key[1]}"]
        before = self.objects.get(key)
        others = self.replica_owners.get(key, set()) - {field_manager}
        # Unforced server-side apply: a field another manager holds at another value is a
        # conflict (only replicas is applied by more than one manager here).
        wanted = obj["spec"].get("replicas") if obj["kind"] == "Deployment" else None
        held = None if before is None or wanted is None else before["spec"]["replicas"]
        if not force and others and held is not None and held != wanted:
            raise KubeError(409, f"Apply failed with 1 conflict: .spec.replicas {others}")
        self.applied.append(f"{key[0]} {key[1]}")
        if field_manager != FIELD_MANAGER:  # the replicas handover: a partial apply
            assert before is not None and set(obj["spec"]) == {"replicas"}, obj
            before["spec"]["replicas"] = obj["spec"]["replicas"]
            self.replica_owners[key].add(field_manager)
            _record_owners(before, self.replica_owners[key])
            return copy.deepcopy(before)
        stored = copy.deepcopy(obj)
        if obj["kind"] == "Deployment":
            # Server-side apply's rule for a field: applying it (forced) makes us its only
            # owner; leaving it out drops our claim, and a field nobody owns is removed
            # (a Deployment's replicas then default to 1).
            owners = self.replica_owners.setdefault(key, set())
            if "replicas" in obj["spec"]:
                owners.clear()
                owners.add(field_manager)
            else:
                owners.discard(field_manager)
                if before is not None and owners:  # another manager's claim keeps it
                    stored["spec"]["replicas"] = before["spec"]["replicas"]
                else:
                    stored["spec"]["replicas"] = 1
            _record_owners(stored, owners)
        body = {k: v for k, v in stored.items() if k not in ("metadata", "status")}
        generation = 1
        if before is not None:
            old_body = {k: v for k, v in before.items() if k not in ("metadata", "status")}
            generation = before["metadata"]["generation"] + (old_body != body)
        stored["metadata"]["generation"] = generation
        if obj["kind"] == "Deployment":
            replicas = stored["spec"]["replicas"]
            stored["status"] = {
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
                "observedGeneration": generation,
            }
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def delete(self, key: ChildKey, namespace: str) -> None:
        self.deleted.append(str(key))
        del self.objects[(key.kind, key.name)]


def _record_owners(obj: dict[str, Any], owners: set[str]) -> None:
    obj["metadata"]["managedFields"] = [
        {"manager": m, "operation": "Apply", "fieldsV1": {"f:spec": {"f:replicas": {}}}}
        for m in sorted(owners)
    ]


def pool_body(spec: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "kvflow.io/v1alpha1",
        "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": generation},
        "spec": spec,
    }


def reconciler(
    kube: FakeKube, events: list[tuple[str, str, str]], policy: AdminPolicy | None = None
) -> Reconciler:
    return Reconciler(
        kube=kube,
        images=Images("w", "r"),
        post_event=lambda body, type_, reason, message: events.append((type_, reason, message)),
        now=lambda: NOW,
        policy=policy or AdminPolicy(),
    )


# The smallest pool the operator deploys: one model, routers that authenticate tenants.
TENANTS = {"tenantsSecret": {"name": "tenants", "key": "tenants.yaml"}}
SPEC = {"model": {"servedName": "m"}, "router": TENANTS}
