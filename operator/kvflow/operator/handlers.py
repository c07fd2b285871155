"""kopf handlers: each one only says which pool (or namespace's gateways) to reconcile, and how.

No handler keeps state on the pool (no finalizers, no progress annotations): the operator
can be stopped, restarted or uninstalled at any time and pools can still be deleted.
Drift is repaired by the periodic sweep in `run.py` and at once when a Deployment of a pool
is deleted.
"""

from __future__ import annotations

from typing import Any

import kopf

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.builders.gateway import LABEL_GATEWAY
from kvflow.operator.builders.names import LABEL_MANAGED_BY, LABEL_POOL, MANAGED_BY
from kvflow.operator.gateway_reconcile import GatewayReconciler
from kvflow.operator.reconcile import Reconciler


def needs_reconcile(*, type: str | None, meta: kopf.Meta, status: kopf.Status, **_: Any) -> bool:
    """Initial listing (operator start), a new pool, or a spec the status has not caught up
    with. Status writes do not bump metadata.generation, so they do not trigger."""
    if type in (None, "ADDED"):
        return True
    if type == "DELETED":
        return False
    return bool(meta.get("generation") != status.get("observedGeneration"))


def changes_serving(*, type: str | None, meta: kopf.Meta, status: kopf.Status, **_: Any) -> bool:
    """An event that can change what a namespace's gateways serve: an object listed, added
    or deleted, or its spec ahead of its status (a pool, gateway or model alike)."""
    if type in (None, "ADDED", "DELETED"):
        return True
    return bool(meta.get("generation") != status.get("observedGeneration"))


def build_registry(
    reconciler: Reconciler, gateways: GatewayReconciler, *, namespaced: bool = False
) -> kopf.OperatorRegistry:
    """`namespaced`: the operator watches only the namespaces it was given (exact names)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A plain OperatorRegistry has no login handlers: in-cluster, then $KUBECONFIG, as
        # the rest of the operator. Not kopf.login_via_client: the `kubernetes` module reads
        # $KUBECONFIG once, at import, before `--kubeconfig` sets it, so with that flag kopf
        # never logged in and only the drift sweep reconciled; kopf's own reader looks now.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # The operator posts its own Events; kopf's per-log-line Events would be noise.
        settings.posting.enabled = False
        # Re-establish watches every 5 minutes even if the connection looks alive.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        # Watching named namespaces, kopf would still list and watch every namespace (to
        # match patterns) and CRDs; the operator's namespaced Roles grant neither (the
        # chart's operator.watchNamespaces). Its --namespace values are exact names, so
        # nothing needs scanning: the InferencePool API is found once, at start.
        settings.scanning.disabled = namespaced

    @kopf.on.event(
        v1alpha1.GROUP, v1alpha1.VERSION, v1alpha1.PLURAL, when=needs_reconcile, registry=registry
    )
    def pool_changed(*, name: str, namespace: str | None, **_: Any) -> None:
        assert namespace is not None, "InferencePool is namespaced"
        reconciler.reconcile(namespace, name, apply=True)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_POOL: kopf.PRESENT},
        registry=registry,
    )
    def deployment_changed(
        *, type: str, labels: kopf.Labels, namespace: str | None, **_: Any
    ) -> None:
        assert namespace is not None, "Deployments are namespaced"
        # A deleted Deployment is drift to repair now; any other change (pods turning
        # ready, a rollout's progress) only moves the pool's status.
        reconciler.reconcile(namespace, labels[LABEL_POOL], apply=type == "DELETED")

    # Gateways: any change to a gateway, a model or a pool reconciles the namespace's
    # gateways (a model moved between gateways changes both; see gateway_reconcile).
    for plural, handler_id in (
        (gw.GATEWAY_PLURAL, "gateway_changed"),
        (gw.MODEL_PLURAL, "model_changed"),
        (v1alpha1.PLURAL, "pool_changed_for_gateways"),
    ):

        @kopf.on.event(
            v1alpha1.GROUP, v1alpha1.VERSION, plural,
            id=handler_id, when=changes_serving, registry=registry,
        )  # fmt: skip
        def serving_changed(*, namespace: str | None, **_: Any) -> None:
            assert namespace is not None, "kvflow.io objects are namespaced"
            gateways.reconcile_namespace(namespace)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_GATEWAY: kopf.PRESENT},
        registry=registry,
    )
    def gateway_deployment_changed(*, type: str, namespace: str | None, **_: Any) -> None:
        assert namespace is not None, "Deployments are namespaced"
        gateways.reconcile_namespace(namespace, apply=type == "DELETED")

    return registry
