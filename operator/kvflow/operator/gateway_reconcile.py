"""One reconcile of a namespace's InferenceGateways: read them with the InferenceModels and
InferencePools they depend on, apply each gateway's children, write the statuses.

A whole namespace at once, because what a gateway serves depends on objects it does not own:
an InferenceModel moved from one gateway to another, or a pool deleted, changes two gateways
or a model's status, and a stateless handler only sees the object as it is now. Gateways per
namespace are few, and applying an unchanged child is a no-op. Like `reconcile`, this module
only reads, applies and reports; the pure builders and `gateway_status` decide.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from kvflow.operator import audit
from kvflow.operator.admin_policy import AdminPolicy, host_path_problems
from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import Json, SchemaError, from_json, to_json
from kvflow.operator.api.validation import auth_problems, router_problems
from kvflow.operator.builders.desired import ChildKey
from kvflow.operator.builders.gateway import (
    GatewayRef,
    desired_gateway_children,
    gateway_endpoint,
    gateway_labels,
    gateway_workload_name,
    worker_token,
)
from kvflow.operator.builders.gateway_models import (
    GatewayProblem,
    ModelObject,
    ModelVerdict,
    resolve,
)
from kvflow.operator.builders.names import Images
from kvflow.operator.gateway_status import gateway_status, model_status
from kvflow.operator.kube import FIELD_MANAGER, KubeError
from kvflow.operator.status import DeploymentObservation

log = logging.getLogger(__name__)

EventSink = Callable[[Json, str, str, str], None]  # (object, type, reason, message)

GATEWAY_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
_REJECTED = (400, 403, 422)  # the API server refused the object (or the operator): report
# Problems that keep a gateway's children from being applied at all: an open gateway, a
# node folder the administrator does not allow, a spec the router would refuse.
_BLOCKING = ("Unauthenticated", "HostPathNotAllowed", "InvalidSpec")


class GatewayKubeApi(Protocol):
    """The calls this module needs (kvflow.operator.kube.Kube; a fake in unit tests)."""

    def list_objects(self, plural: str, namespaces: list[str]) -> list[Json]: ...
    def list_pool_objects(self, namespaces: list[str]) -> list[Json]: ...
    def patch_object_status(self, plural: str, namespace: str, name: str, status: Json) -> None: ...
    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Json]: ...
    def apply(self, obj: Json, field_manager: str = FIELD_MANAGER) -> Json: ...
    def delete(self, key: ChildKey, namespace: str) -> None: ...


@dataclass
class GatewayReconciler:
    kube: GatewayKubeApi
    images: Images
    post_event: EventSink
    now: Callable[[], str]  # RFC 3339, UTC
    policy: AdminPolicy = field(default_factory=AdminPolicy)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def _lock(self, namespace: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(namespace, threading.Lock())

    def reconcile_namespace(self, namespace: str, *, apply: bool = True) -> None:
        """Converge every gateway of `namespace`; `apply=False` only refreshes statuses."""
        with self._lock(namespace):
            gateways = [
                g
                for g in self.kube.list_objects(gw.GATEWAY_PLURAL, [namespace])
                if not g["metadata"].get("deletionTimestamp")
            ]
            models = self.kube.list_objects(gw.MODEL_PLURAL, [namespace])
            if not gateways and not models:
                return
            pools = _pool_specs(self.kube.list_pool_objects([namespace]))
            by_gateway: dict[str, list[tuple[Json, ModelObject]]] = {}
            for body in sorted(models, key=_age):
                try:
                    spec = from_json(gw.InferenceModelSpec, body.get("spec") or {})
                except SchemaError as exc:
                    log.warning("skipping unreadable InferenceModel: %s", exc)
                    continue
                model = ModelObject(body["metadata"]["name"], spec)
                by_gateway.setdefault(spec.gateway_ref.name, []).append((body, model))
            for body in gateways:
                self._reconcile_gateway(body, by_gateway.pop(body["metadata"]["name"], []),
                                        pools, apply=apply)  # fmt: skip
            for name, orphans in by_gateway.items():
                for body, _ in orphans:
                    self._write_model(body, name, None)

    def _reconcile_gateway(
        self,
        body: Json,
        models: Sequence[tuple[Json, ModelObject]],
        pools: Mapping[str, v1alpha1.InferencePoolSpec],
        *,
        apply: bool,
    ) -> None:
        meta = body["metadata"]
        ref = GatewayRef(
            meta["name"], meta["namespace"], meta["uid"], int(meta.get("generation") or 0)
        )
        previous = _previous(gw.InferenceGatewayStatus, body)
        try:
            spec = from_json(gw.InferenceGatewaySpec, body.get("spec") or {})
        except SchemaError as exc:  # only when the installed CRD is older than the operator
            self._write_gateway(body, ref, previous, [], 0, None,
                                [GatewayProblem("InvalidSpec", str(exc))])  # fmt: skip
            return
        resolution = resolve(
            [m for _, m in models],
            pools,
            response_cache=spec.router.response_cache.enabled,
            semantic_cache=spec.semantic_cache,
        )
        problems = [GatewayProblem("Unauthenticated", p) for p in auth_problems(spec.router)]
        problems += list(resolution.problems)
        # The gateway mounts the model volume of every pool it fronts.
        problems += [
            GatewayProblem(p.reason, p.message)
            for name in resolution.pools
            for p in host_path_problems(f"pool {name}: ", pools[name].model, self.policy)
        ]
        problems += [GatewayProblem("InvalidSpec", p) for p in router_problems(spec.router)]
        _, token_problems = worker_token(resolution.pools, pools)
        problems += [GatewayProblem("WorkerTokenMismatch", p) for p in token_problems]
        observed = self._observe(ref)
        if apply and not any(p.reason in _BLOCKING for p in problems):
            desired = desired_gateway_children(
                ref, spec, self.images, resolution, pools, self.policy.metrics_scrapers
            )
            applied, changes = self._apply(body, ref, desired, observed)
            problems += applied
            if changes:
                event = audit.gateway_applied_event(
                    body, spec.router, list(resolution.models), changes, time.time()
                )
                audit.log_event(event)
        deployment = observed.get(ChildKey("apps/v1", "Deployment", gateway_workload_name(ref)))
        replicas = spec.router.replicas if resolution.pools else 0
        if not apply:  # a status refresh claims no generation it did not apply (reconcile.py)
            ref = replace(ref, generation=previous.observed_generation)
        self._write_gateway(
            body, ref, previous, list(resolution.models), replicas,
            None if deployment is None else DeploymentObservation.from_object(deployment),
            problems, port=spec.router.port,
        )  # fmt: skip
        for model_body, model in models:
            self._write_model(model_body, ref.name, resolution.verdicts.get(model.name))

    def _observe(self, ref: GatewayRef) -> dict[ChildKey, Json]:
        """The gateway's children: labelled as ours and controlled by this very gateway."""
        observed: dict[ChildKey, Json] = {}
        for api_version, kind in GATEWAY_KINDS:
            for obj in self.kube.list_children(kind, ref.namespace, gateway_labels(ref)):
                owners = obj["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == ref.uid and o.get("controller") for o in owners):
                    obj.setdefault("kind", kind)
                    obj.setdefault("apiVersion", api_version)
                    observed[ChildKey.of(obj)] = obj
        return observed

    def _apply(
        self, body: Json, ref: GatewayRef, desired: list[Json], observed: dict[ChildKey, Json]
    ) -> tuple[list[GatewayProblem], list[str]]:
        """Apply the children; the problems, and what changed (for the audit trail)."""
        problems: list[GatewayProblem] = []
        changes: list[str] = []
        for obj in desired:
            key = ChildKey.of(obj)
            before = observed.get(key)
            try:
                after = self.kube.apply(obj)
            except KubeError as exc:
                if exc.status not in _REJECTED:
                    raise
                problems.append(GatewayProblem("ApplyRejected", f"{key}: {exc.message}"))
                continue
            observed[key] = after
            if before is None:
                self.post_event(body, "Normal", "Created", f"Created {key}")
                changes.append(f"created {key}")
            elif before["metadata"].get("generation") != after["metadata"].get("generation"):
                self.post_event(body, "Normal", "Updated", f"Updated {key}")
                changes.append(f"updated {key}")
        for key in sorted(set(observed) - {ChildKey.of(o) for o in desired}, key=str):
            self.kube.delete(key, ref.namespace)
            del observed[key]
            changes.append(f"deleted {key}")
        return problems, changes

    def _write_gateway(
        self,
        body: Json,
        ref: GatewayRef,
        previous: gw.InferenceGatewayStatus,
        models: list[gw.ResolvedModel],
        replicas: int,
        deployment: DeploymentObservation | None,
        problems: list[GatewayProblem],
        port: int = 80,
    ) -> None:
        status = gateway_status(
            generation=ref.generation,
            endpoint=gateway_endpoint(ref, port),
            models=models,
            replicas=replicas,
            deployment=deployment,
            problems=problems,
            previous=previous,
            now=self.now(),
        )
        status_json = to_json(status)
        if status_json == to_json(previous):
            return
        self.kube.patch_object_status(gw.GATEWAY_PLURAL, ref.namespace, ref.name, status_json)
        if status.phase != previous.phase:
            wanted = "Degraded" if status.phase == "Degraded" else "Ready"
            message = next((c.message for c in status.conditions if c.type == wanted), "")
            self.post_event(
                body,
                "Warning" if status.phase == "Degraded" else "Normal",
                status.phase,
                f"Gateway is {status.phase}" + (f": {message}" if message else ""),
            )

    def _write_model(self, body: Json, gateway: str, verdict: ModelVerdict | None) -> None:
        meta = body["metadata"]
        previous = _previous(gw.InferenceModelStatus, body)
        status = model_status(
            gateway=gateway,
            verdict=verdict,
            generation=int(meta.get("generation") or 0),
            previous=previous,
            now=self.now(),
        )
        status_json = to_json(status)
        if status_json != to_json(previous):
            self.kube.patch_object_status(
                gw.MODEL_PLURAL, meta["namespace"], meta["name"], status_json
            )


def _pool_specs(bodies: list[Json]) -> dict[str, v1alpha1.InferencePoolSpec]:
    """The namespace's pools a gateway can front: a pool being deleted or unreadable is
    reported as missing."""
    specs: dict[str, v1alpha1.InferencePoolSpec] = {}
    for body in bodies:
        if body["metadata"].get("deletionTimestamp"):
            continue
        try:
            specs[body["metadata"]["name"]] = from_json(
                v1alpha1.InferencePoolSpec, body.get("spec") or {}
            )
        except SchemaError:
            continue
    return specs


def _age(body: Json) -> tuple[str, str]:
    """Oldest first (RFC 3339 sorts as text); the name breaks ties."""
    meta = body["metadata"]
    return (str(meta.get("creationTimestamp") or ""), str(meta["name"]))


S = TypeVar("S", gw.InferenceGatewayStatus, gw.InferenceModelStatus)


def _previous(cls: type[S], body: Json) -> S:
    try:
        return from_json(cls, body.get("status") or {})
    except SchemaError:
        return cls()
