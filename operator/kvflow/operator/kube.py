"""The operator's only door to the API server: a few calls on JSON objects.

Everything goes through the `kubernetes` client's typed APIs with `_preload_content=False`,
so callers see plain JSON (the same shapes the builders produce and the tests read) rather
than generated model classes. Children are written with server-side apply under one field
manager: applying the same object twice is a no-op, a missing object is created, drifted
fields are put back, and fields other managers own (an HPA's replicas, say) are left alone
unless they conflict with ours.

Every call here is listed in the chart's RBAC (`NAMESPACED_RULES` and `CLUSTER_RULES` below
are the source the chart's test compares against): least privilege means exactly these
verbs, and with watched namespaces only in them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.desired import ChildKey

FIELD_MANAGER = "kvflow-operator"
APPLY = "application/apply-patch+yaml"  # JSON is YAML, so the JSON body is sent as is
MERGE = "application/merge-patch+json"

# What the operator does, resource by resource, in the namespaces it watches: with the
# chart's operator.watchNamespaces a Role in each of them, else part of the ClusterRole.
NAMESPACED_RULES: list[dict[str, list[str]]] = [
    {
        "apiGroups": [v1alpha1.GROUP],
        "resources": [v1alpha1.PLURAL],
        # list/watch: kopf's watch and the drift sweep; get: re-read before reconciling.
        # No patch: the operator keeps no state on pools (no finalizers, no annotations).
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [v1alpha1.GROUP], "resources": [f"{v1alpha1.PLURAL}/status"], "verbs": ["patch"]},
    {
        # Gateways and the models they serve: read like pools, status written.
        "apiGroups": [v1alpha1.GROUP],
        "resources": [gw.GATEWAY_PLURAL, gw.MODEL_PLURAL],
        "verbs": ["get", "list", "watch"],
    },
    {
        "apiGroups": [v1alpha1.GROUP],
        "resources": [f"{gw.GATEWAY_PLURAL}/status", f"{gw.MODEL_PLURAL}/status"],
        "verbs": ["patch"],
    },
    {
        # Children name their owner with blockOwnerDeletion; where the API server enforces
        # OwnerReferencesPermissionEnforcement (OpenShift does), setting it needs update on
        # the owner's finalizers. The operator sets no finalizer.
        "apiGroups": [v1alpha1.GROUP],
        "resources": [f"{v1alpha1.PLURAL}/finalizers", f"{gw.GATEWAY_PLURAL}/finalizers"],
        "verbs": ["update"],
    },
    {
        # watch: kopf reacts to a deleted or changed Deployment; create: server-side apply
        # of a missing object is authorized as a create too.
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["configmaps", "services"],
        "verbs": ["list", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["list", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["list", "create", "patch", "delete"],
    },
    # A pool's generated worker token (builders/worker_token.py): created once, never read
    # (no get, list or watch: the operator cannot read any Secret).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # The planner counts a pool's ready and unschedulable pods and reads their /metrics.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]
# What only a ClusterRole can grant, whatever the operator watches.
CLUSTER_RULES: list[dict[str, list[str]]] = [
    {
        # kopf watches CRDs to notice the InferencePool API appearing or going away.
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
]
# The chart's ClusterRole when the operator watches every namespace.
RBAC_RULES = NAMESPACED_RULES + CLUSTER_RULES
# Leader election, in the operator's own namespace only (a Role, not the ClusterRole).
LEASE_RULES: list[dict[str, list[str]]] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    }
]
EVENT_SOURCE = "kvflow-operator"


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status, `message` the API server's text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG)."""
    if kubeconfig is None:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return client.ApiClient()
        except config.ConfigException:
            pass
    configuration = client.Configuration()
    config.load_kube_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, client_configuration=configuration
    )
    return client.ApiClient(configuration)


# No call may hang: a stuck request would stall a reconcile thread, or keep a stopping
# operator from exiting. 30 s is far above an API server's normal latency (~10 ms).
REQUEST_TIMEOUT_S = 30


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Json:
    try:
        response = fn(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        # No answer at all (refused, reset, timed out: an API server restarting). A
        # KubeError like any other, so every caller's retry covers it: raw, it ended the
        # leader's renewals without saying the lease was lost, a standby's wait for the
        # lease as if it had won it, and the drift and planner loops for good.
        raise KubeError(0, f"the API server did not answer: {exc}") from exc
    except ApiException as exc:
        message = exc.reason or ""
        if exc.body:
            try:
                message = json.loads(exc.body).get("message", message)
            except (ValueError, AttributeError):
                message = str(exc.body)
        raise KubeError(int(exc.status or 0), message) from exc
    data = response.data
    return json.loads(data) if data else {}


@dataclass(frozen=True)
class _KindApi:
    list: Callable[..., Any]
    patch: Callable[..., Any]
    delete: Callable[..., Any]


class Kube:
    """Calls on one cluster. Thread-safe as the `kubernetes` client is (kopf runs sync
    handlers in a thread pool)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        core = client.CoreV1Api(api_client)
        apps = client.AppsV1Api(api_client)
        policy = client.PolicyV1Api(api_client)
        networking = client.NetworkingV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._core = core
        self._coordination = client.CoordinationV1Api(api_client)
        self._kinds: dict[str, _KindApi] = {
            "ConfigMap": _KindApi(
                core.list_namespaced_config_map,
                core.patch_namespaced_config_map,
                core.delete_namespaced_config_map,
            ),
            "Service": _KindApi(
                core.list_namespaced_service,
                core.patch_namespaced_service,
                core.delete_namespaced_service,
            ),
            "Deployment": _KindApi(
                apps.list_namespaced_deployment,
                apps.patch_namespaced_deployment,
                apps.delete_namespaced_deployment,
            ),
            "PodDisruptionBudget": _KindApi(
                policy.list_namespaced_pod_disruption_budget,
                policy.patch_namespaced_pod_disruption_budget,
                policy.delete_namespaced_pod_disruption_budget,
            ),
            "NetworkPolicy": _KindApi(
                networking.list_namespaced_network_policy,
                networking.patch_namespaced_network_policy,
                networking.delete_namespaced_network_policy,
            ),
        }

    def get_pool(self, namespace: str, name: str) -> Json | None:
        try:
            return _call(
                self._custom.get_namespaced_custom_object,
                v1alpha1.GROUP,
                v1alpha1.VERSION,
                namespace,
                v1alpha1.PLURAL,
                name,
            )
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list_pools(self, namespaces: list[str]) -> list[tuple[str, str]]:
        """(namespace, name) of every pool in `namespaces` (all namespaces when empty)."""
        return [
            (item["metadata"]["namespace"], item["metadata"]["name"])
            for item in self.list_pool_objects(namespaces)
        ]

    def list_pool_objects(self, namespaces: list[str]) -> list[Json]:
        """Every pool in `namespaces` (all namespaces when empty), as the API server has it."""
        if namespaces:
            listed = [
                _call(
                    self._custom.list_namespaced_custom_object,
                    v1alpha1.GROUP,
                    v1alpha1.VERSION,
                    ns,
                    v1alpha1.PLURAL,
                )
                for ns in namespaces
            ]
        else:
            listed = [
                _call(
                    self._custom.list_cluster_custom_object,
                    v1alpha1.GROUP,
                    v1alpha1.VERSION,
                    v1alpha1.PLURAL,
                )
            ]
        return [item for page in listed for item in page.get("items", [])]

    def get_object(self, plural: str, namespace: str, name: str) -> Json | None:
        """A kvflow.io object (a gateway or model; pools have get_pool); None when gone."""
        try:
            return _call(
                self._custom.get_namespaced_custom_object,
                v1alpha1.GROUP, v1alpha1.VERSION, namespace, plural, name,
            )  # fmt: skip
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list_objects(self, plural: str, namespaces: list[str]) -> list[Json]:
        """Every kvflow.io object of `plural` in `namespaces` (all when empty)."""
        if not namespaces:
            page = _call(
                self._custom.list_cluster_custom_object, v1alpha1.GROUP, v1alpha1.VERSION, plural
            )
            return list(page.get("items", []))
        items: list[Json] = []
        for ns in namespaces:
            page = _call(
                self._custom.list_namespaced_custom_object,
                v1alpha1.GROUP, v1alpha1.VERSION, ns, plural,
            )  # fmt: skip
            items += page.get("items", [])
        return items

    def patch_object_status(self, plural: str, namespace: str, name: str, status: Json) -> None:
        _call(
            self._custom.patch_namespaced_custom_object_status,
            v1alpha1.GROUP, v1alpha1.VERSION, namespace, plural, name,
            {"status": status},
            _content_type=MERGE,
        )  # fmt: skip

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[Json]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        listed = _call(self._core.list_namespaced_pod, namespace, label_selector=label_selector)
        items: list[Json] = listed.get("items", [])
        return items

    def post_event(self, obj: Json, type_: str, reason: str, message: str, now: str) -> None:
        """A core/v1 Event about `obj` (what `kubectl describe` shows under Events)."""
        meta = obj["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj["apiVersion"],
                "kind": obj["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": EVENT_SOURCE},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        _call(self._core.create_namespaced_event, meta["namespace"], event)

    def read_lease(self, namespace: str, name: str) -> Json | None:
        try:
            return _call(self._coordination.read_namespaced_lease, name, namespace)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def create_lease(self, namespace: str, lease: Json) -> Json:
        return _call(self._coordination.create_namespaced_lease, namespace, lease)

    def replace_lease(self, namespace: str, name: str, lease: Json) -> Json:
        """Fails with 409 when `lease` carries a stale resourceVersion (someone else won)."""
        return _call(self._coordination.replace_namespaced_lease, name, namespace, lease)

    def patch_pool_status(self, namespace: str, name: str, status: Json) -> None:
        _call(
            self._custom.patch_namespaced_custom_object_status,
            v1alpha1.GROUP,
            v1alpha1.VERSION,
            namespace,
            v1alpha1.PLURAL,
            name,
            {"status": status},
            _content_type=MERGE,
        )

    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Json]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        listed = _call(self._kinds[kind].list, namespace, label_selector=label_selector)
        items: list[Json] = listed.get("items", [])
        return items

    def apply(self, obj: Json, field_manager: str = FIELD_MANAGER, *, force: bool = True) -> Json:
        """Server-side apply: create, or update the fields we manage; `force` takes back
        fields someone edited by hand (that is the drift being repaired); unforced, a field
        another manager holds at another value is a 409. Another `field_manager` and
        `force=False` only for the replicas handover (`builders.replicas`)."""
        meta = obj["metadata"]
        return _call(
            self._kinds[obj["kind"]].patch,
            meta["name"],
            meta["namespace"],
            obj,
            field_manager=field_manager,
            force=force,
            _content_type=APPLY,
        )

    def create_secret(self, secret: Json) -> bool:
        """Create `secret` unless one of its name exists: True when created. Never an
        update, so an existing Secret (a token the pods already use) is left as it is."""
        try:
            _call(
                self._core.create_namespaced_secret,
                secret["metadata"]["namespace"],
                secret,
                field_manager=FIELD_MANAGER,
            )
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def delete(self, key: ChildKey, namespace: str) -> None:
        try:
            _call(
                self._kinds[key.kind].delete,
                key.name,
                namespace,
                propagation_policy="Background",
            )
        except KubeError as exc:
            if exc.status != 404:
                raise
