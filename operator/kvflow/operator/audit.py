"""The audit trail of what the operator applies: one JSON line on the ``kvflow.audit``
logger each time a pool's or gateway's spec (or, for a gateway, its InferenceModels)
changes what runs (children created, updated or deleted),
saying which pool, which generation, who last wrote its spec (the field managers in its
managedFields), and what security and routing state is now in force: the tenants Secret
(by name), whether callers may be anonymous, the worker token's Secret, the served model
and the routing weights. Secret names only, never their contents. The event is pure; the
reconciler logs it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

from kvflow.operator.api import v1alpha1, v1alpha1_router
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_gateway import ResolvedModel
from kvflow.operator.builders.worker_token import effective_worker_token
from kvflow.operator.kube import FIELD_MANAGER

audit_log = logging.getLogger("kvflow.audit")
audit_log.setLevel(logging.INFO)  # kept at the operator's warning level too


def spec_writers(body: Json) -> list[str]:
    """The field managers that own part of the spec (kubectl, a CD tool), not the operator."""
    managers = set()
    for entry in body.get("metadata", {}).get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        if "f:spec" in fields and entry.get("manager") != FIELD_MANAGER:
            managers.add(str(entry.get("manager")))
    return sorted(managers)


def _applied(
    kind: str, body: Json, router: v1alpha1_router.RouterSpec, changes: list[str], now_s: float
) -> dict[str, Any]:
    """What a pool's and a gateway's events share: which object, who wrote its spec, what
    changed, and who may call it."""
    meta = body["metadata"]
    return {
        "event": f"{kind}_applied",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now_s)),
        "namespace": meta["namespace"],
        kind: meta["name"],
        "generation": int(meta.get("generation") or 0),
        "spec_written_by": spec_writers(body),
        "changes": changes,
        "tenants_secret": None if router.tenants_secret is None else router.tenants_secret.name,
        "allow_unauthenticated": router.allow_unauthenticated,
        "service_type": router.service_type,
    }


def pool_applied_event(
    body: Json, spec: v1alpha1.InferencePoolSpec, changes: list[str], now_s: float
) -> dict[str, Any]:
    router = spec.router
    token = effective_worker_token(body["metadata"]["name"], spec)
    weights = router.scorer_weights
    return {
        **_applied("pool", body, router, changes, now_s),
        "worker_token_secret": token.name,
        "served_model": spec.model.served_name,
        # Every scorer weight the spec sets, under the router's scorer name (= the field's).
        "routing_weights": {
            f.name: getattr(weights, f.name)
            for f in dataclasses.fields(weights)
            if getattr(weights, f.name) is not None
        },
    }


def gateway_applied_event(
    body: Json,
    router: v1alpha1_router.RouterSpec,
    models: list[ResolvedModel],
    changes: list[str],
    now_s: float,
) -> dict[str, Any]:
    """An InferenceGateway's: the same security state, and the model routing now in force
    (each public name, its aliases and its pools with their weights)."""
    return {
        **_applied("gateway", body, router, changes, now_s),
        "models": {
            m.name: {
                "aliases": list(m.aliases),
                "targets": {t.pool: t.weight for t in m.targets},
                "source": m.source,
            }
            for m in models
        },
    }


def log_event(event: dict[str, Any]) -> None:
    audit_log.info(json.dumps(event, sort_keys=True))
