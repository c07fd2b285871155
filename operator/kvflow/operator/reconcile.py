"""One reconcile of one pool: read it, apply its children, prune, write status.

Every kopf handler ends here, so a pool converges the same way whether it was just created,
edited, found drifted by the timer, or had a Deployment deleted under it; running it twice
changes nothing the second time. The pure parts (builders, validation, status) decide; this
module only reads, applies and reports. It imports no kopf: handlers pass in how to post
Events, and the unit tests pass a fake `Kube`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvflow.operator import audit
from kvflow.operator.admin_policy import AdminPolicy, pool_policy_problems
from kvflow.operator.api import v1alpha1, v1alpha1_status
from kvflow.operator.api.schema import Json, SchemaError, from_json, to_json
from kvflow.operator.api.validation import auth_problems, spec_problems
from kvflow.operator.builders.desired import OWNED_KINDS, ChildKey, desired_children
from kvflow.operator.builders.names import (
    Images,
    PoolRef,
    WorkerRole,
    pool_labels,
    worker_deployment_name,
    worker_roles,
)
from kvflow.operator.builders.replicas import (
    HANDOVER_MANAGER,
    applied_replicas,
    handover_patch,
    needs_handover,
    planned_replicas,
)
from kvflow.operator.builders.worker_token import (
    generated_token_secret,
    generated_token_secret_name,
)
from kvflow.operator.kube import FIELD_MANAGER, KubeError
from kvflow.operator.planner.types import Decision, SloVerdict
from kvflow.operator.status import (
    DeploymentObservation,
    Problem,
    compute_status,
    unreadable_status,
    with_plan,
)

log = logging.getLogger(__name__)

# (pool body, "Normal" | "Warning", reason, message)
EventSink = Callable[[Json, str, str, str], None]


class KubeApi(Protocol):
    """The calls reconcile needs (kvflow.operator.kube.Kube; a fake in unit tests)."""

    def get_pool(self, namespace: str, name: str) -> Json | None: ...
    def patch_pool_status(self, namespace: str, name: str, status: Json) -> None: ...
    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Json]: ...
    def apply(
        self, obj: Json, field_manager: str = FIELD_MANAGER, *, force: bool = True
    ) -> Json: ...
    def delete(self, key: ChildKey, namespace: str) -> None: ...
    def create_secret(self, secret: Json) -> bool: ...


@dataclass(frozen=True)
class PlanOutcome:
    """What one planner interval decided for the roles it scales."""

    decisions: tuple[Decision, ...]  # of the roles the planner moves
    scaled_roles: tuple[str, ...]  # those roles (a role with no decision yet included)
    slo: SloVerdict


PlanFn = Callable[[Json], PlanOutcome | None]

# 400/422: the API server refused the object itself (a spec the schema let through but a
# child's validation does not). 403: it refused the operator (its RBAC, or an admission
# plugin such as OwnerReferencesPermissionEnforcement). Retrying cannot help until the spec
# or the cluster changes: report it in the pool's status, where its user looks.
_REJECTED = (400, 403, 422)


@dataclass
class Reconciler:
    kube: KubeApi
    images: Images
    post_event: EventSink
    now: Callable[[], str]  # RFC 3339, UTC
    policy: AdminPolicy = field(default_factory=AdminPolicy)
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        # The drift sweep, a pool's handler and its Deployments' handler may run at once
        # (kopf runs sync handlers in threads); one at a time per pool keeps Events and
        # status writes in order.
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, namespace: str, name: str, *, apply: bool = True) -> None:
        """Converge pool `namespace/name`; `apply=False` only refreshes its status."""
        with self._lock(namespace, name):
            body = self.kube.get_pool(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return  # garbage collection removes the children
            self._reconcile(body, apply=apply)

    def record_plan(self, namespace: str, name: str, decide: PlanFn) -> PlanOutcome | None:
        """One planner interval under the pool's lock: `decide(pool)` (the model, given the
        pool as it is now), then status (replicas, reason, SLOMet) and the Deployments that
        follow from it. None when the pool is gone or `decide` declined."""
        with self._lock(namespace, name):
            body = self.kube.get_pool(namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return None
            outcome = decide(body)
            if outcome is None:
                return None
            status = with_plan(
                _previous_status(body),
                decisions=outcome.decisions,
                scaled_roles=outcome.scaled_roles,
                slo=outcome.slo,
                now=self.now(),
                generation=int(body["metadata"].get("generation") or 0),
            )
            status_json = to_json(status)
            if status_json != to_json(_previous_status(body)):
                self.kube.patch_pool_status(namespace, name, status_json)
            self._reconcile({**body, "status": status_json}, apply=True)
            return outcome

    def _reconcile(self, body: Json, *, apply: bool) -> None:
        meta = body["metadata"]
        pool = PoolRef(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
        )
        try:
            spec = from_json(v1alpha1.InferencePoolSpec, body.get("spec") or {})
        except SchemaError as exc:  # only when the installed CRD is older than the operator
            problem = Problem("InvalidSpec", str(exc))
            previous = _previous_status(body)
            self._write(
                body, pool, unreadable_status(problem, previous, pool.generation, self.now())
            )
            return
        # Authentication first: its reason is the one the conditions show.
        problems = [Problem("Unauthenticated", p) for p in auth_problems(spec.router)]
        problems += [Problem(p.reason, p.message) for p in pool_policy_problems(spec, self.policy)]
        problems += [Problem("InvalidSpec", p) for p in spec_problems(spec)]
        observed = self._observe(pool)
        replicas = applied_replicas(spec, planned_replicas(_previous_status(body)))
        if not problems and apply:
            problems += self._apply(body, pool, spec, observed, replicas)
        if not apply:
            # A status refresh (a Deployment moved) applied nothing: it reports the
            # generation last applied, never claims the current one. Otherwise a Deployment
            # event landing between a spec edit and its apply marks the edit done, and
            # whoever waits on observedGeneration (`kubectl wait`, a CD tool, an HPA set up
            # after a handover) acts before the operator has.
            pool = replace(pool, generation=_previous_status(body).observed_generation)
        self._write_status(body, pool, spec, observed, problems, replicas)

    def _observe(self, pool: PoolRef) -> dict[ChildKey, Json]:
        """The pool's children now: labelled as ours and controlled by this very pool (a
        recreated pool of the same name must not adopt its predecessor's leftovers)."""
        observed: dict[ChildKey, Json] = {}
        for _, kind in OWNED_KINDS:
            for obj in self.kube.list_children(kind, pool.namespace, pool_labels(pool)):
                owners = obj["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == pool.uid and o.get("controller") for o in owners):
                    obj.setdefault("kind", kind)
                    obj.setdefault("apiVersion", _api_version(kind))
                    observed[ChildKey.of(obj)] = obj
        return observed

    def _apply(
        self,
        body: Json,
        pool: PoolRef,
        spec: v1alpha1.InferencePoolSpec,
        observed: dict[ChildKey, Json],
        replicas: dict[WorkerRole, int | None],
    ) -> list[Problem]:
        problems: list[Problem] = []
        changes: list[str] = []  # for the audit trail
        if spec.worker_token_secret is None and self.kube.create_secret(
            generated_token_secret(pool)
        ):
            self.post_event(
                body,
                "Normal",
                "Created",
                f"Created Secret {generated_token_secret_name(pool.name)}",
            )
            changes.append(f"created Secret {generated_token_secret_name(pool.name)}")
        desired = desired_children(pool, spec, self.images, replicas, self.policy.metrics_scrapers)
        seeds = {worker_deployment_name(pool, role): rs.replicas for role, rs in worker_roles(spec)}
        for obj in desired:
            key = ChildKey.of(obj)
            before = observed.get(key)
            try:
                if key.kind == "Deployment" and key.name in seeds and "replicas" not in obj["spec"]:
                    self._hand_over_replicas(obj, before, seeds[key.name])
                after = self.kube.apply(obj)
            except KubeError as exc:
                if exc.status not in _REJECTED:
                    raise
                problems.append(Problem("ApplyRejected", f"{key}: {exc.message}"))
                continue
            observed[key] = after
            if before is None:
                self.post_event(body, "Normal", "Created", f"Created {key}")
                changes.append(f"created {key}")
            elif _version(before) != _version(after):
                self.post_event(body, "Normal", "Updated", f"Updated {key}")
                changes.append(f"updated {key}")
        wanted = {ChildKey.of(obj) for obj in desired}
        for key in sorted(set(observed) - wanted, key=str):
            # A role the spec no longer has (mode switched, say).
            self.kube.delete(key, pool.namespace)
            del observed[key]
            self.post_event(body, "Normal", "Deleted", f"Deleted {key}: no longer in the spec")
            changes.append(f"deleted {key}")
        if changes:
            audit.log_event(audit.pool_applied_event(body, spec, changes, time.time()))
        return problems

    def _hand_over_replicas(self, obj: Json, before: Json | None, seed: int) -> None:
        """Before the operator applies a Deployment without replicas (an external
        autoscaler's role), make sure it is not the field's only owner: server-side apply
        would remove the field, and the Deployment would drop to 1 replica. A new
        Deployment is created with `seed` replicas first."""
        if not needs_handover(before, FIELD_MANAGER):
            return
        if before is None:
            before = self.kube.apply({**obj, "spec": {**obj["spec"], "replicas": seed}})
        current = int(before.get("spec", {}).get("replicas", seed))
        try:
            # Not forced: `before` was read a moment ago, and an autoscaler may have scaled
            # since. Forcing would put the old count back over its decision; unforced, the
            # API server answers 409 because the autoscaler now owns the field, which is
            # the handover done by someone else.
            self.kube.apply(
                handover_patch(obj, current), field_manager=HANDOVER_MANAGER, force=False
            )
        except KubeError as exc:
            if exc.status != 409:
                raise
            log.info("%s: replicas already taken over (%s)", obj["metadata"]["name"], exc.message)

    def _write_status(
        self,
        body: Json,
        pool: PoolRef,
        spec: v1alpha1.InferencePoolSpec,
        observed: dict[ChildKey, Json],
        problems: list[Problem],
        replicas: dict[WorkerRole, int | None],
    ) -> None:
        status = compute_status(
            pool=pool,
            spec=spec,
            deployments={
                key.name: DeploymentObservation.from_object(obj)
                for key, obj in observed.items()
                if key.kind == "Deployment"
            },
            problems=problems,
            previous=_previous_status(body),
            now=self.now(),
            replicas=replicas,
        )
        self._write(body, pool, status)

    def _write(
        self, body: Json, pool: PoolRef, status: v1alpha1_status.InferencePoolStatus
    ) -> None:
        """Write status when it changed; an Event when the phase changed."""
        previous = _previous_status(body)
        status_json = to_json(status)
        if status_json == to_json(previous):
            return
        self.kube.patch_pool_status(pool.namespace, pool.name, status_json)
        if status.phase != previous.phase:
            degraded = status.phase == "Degraded"
            wanted = "Degraded" if degraded else "Ready"
            message = next((c.message for c in status.conditions if c.type == wanted), "")
            self.post_event(
                body,
                "Warning" if degraded else "Normal",
                status.phase,
                f"Pool is {status.phase}" + (f": {message}" if message else ""),
            )


def _previous_status(body: Json) -> v1alpha1_status.InferencePoolStatus:
    try:
        return from_json(v1alpha1_status.InferencePoolStatus, body.get("status") or {})
    except SchemaError:
        log.warning("ignoring an unreadable status of %s", body["metadata"]["name"])
        return v1alpha1_status.InferencePoolStatus()


def _version(obj: Json) -> str:
    """What changes when the object's desired state changes: its generation where it has
    one (a PDB's or Deployment's status updates bump resourceVersion, not generation)."""
    meta = obj.get("metadata", {})
    generation = meta.get("generation")
    return f"g{generation}" if generation is not None else f"rv{meta.get('resourceVersion', '')}"


def _api_version(kind: str) -> str:
    return next(api for api, k in OWNED_KINDS if k == kind)
