"""What the reconcile refuses and protects: pools without tenant authentication, host paths
and Prometheus URLs outside the admin policy, the workers' token Secret, and the audit trail
of what the operator applies (against testkit.pool_kube's fake API)."""

from __future__ import annotations

from typing import Any

import pytest
from testkit.pool_kube import SPEC, FakeKube, pool_body, reconciler

from kvflow.operator.admin_policy import AdminPolicy
from kvflow.operator.kube import FIELD_MANAGER


def degraded(kube: FakeKube) -> dict[str, Any]:
    assert kube.pool is not None and kube.pool["status"]["phase"] == "Degraded"
    found: dict[str, Any] = next(
        c for c in kube.pool["status"]["conditions"] if c["type"] == "Degraded"
    )
    return found


def test_a_pool_without_tenants_stored_before_the_crd_rule_is_not_deployed(
    events: list[Any],
) -> None:
    """The CRD refuses it; one stored earlier (or under an older CRD) is refused here."""
    kube = FakeKube(pool_body({"model": {"servedName": "m"}}))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.applied == [] and kube.secrets == {}
    condition = degraded(kube)
    assert condition["reason"] == "Unauthenticated"
    assert "router.tenantsSecret is not set" in condition["message"]


def test_an_unauthenticated_pool_is_deployed_only_when_it_says_so(events: list[Any]) -> None:
    open_spec = {"model": {"servedName": "m"}, "router": {"allowUnauthenticated": True}}
    kube = FakeKube(pool_body(open_spec))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.pool is not None and kube.pool["status"]["phase"] == "Ready"
    exposed = {**open_spec, "router": {"allowUnauthenticated": True, "serviceType": "NodePort"}}
    kube = FakeKube(pool_body(exposed))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.applied == []
    assert degraded(kube)["reason"] == "Unauthenticated"
    assert "serviceType NodePort" in degraded(kube)["message"]


def token_env(kube: FakeKube, deployment: str) -> Any:
    (container,) = kube.objects[("Deployment", deployment)]["spec"]["template"]["spec"][
        "containers"
    ]
    return next(e for e in container["env"] if e["name"] == "KVFLOW_WORKER_TOKEN")


def test_the_generated_worker_token_is_created_once_and_wired_like_a_users(
    events: list[Any],
) -> None:
    kube = FakeKube(pool_body(SPEC))
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    secret = kube.secrets["p-worker-token"]
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferencePool", "u1", True)
    token = secret["data"]["token"]
    assert len(token) >= 40  # 32 random bytes, base64 twice over
    wired = {"valueFrom": {"secretKeyRef": {"name": "p-worker-token", "key": "token"}}}
    for deployment in ("p-colocated", "p-router"):
        assert token_env(kube, deployment) == {"name": "KVFLOW_WORKER_TOKEN", **wired}
    # Never rotated: later reconciles only ask to create it, which finds it there.
    r.reconcile("ns", "p")
    r.reconcile("ns", "p")
    assert kube.secrets["p-worker-token"]["data"]["token"] == token
    assert kube.secret_creates == 3
    # Never in an Event (nor anywhere the operator writes).
    assert not any(token in message for _, _, message in events)


def test_a_users_worker_token_secret_is_used_and_none_is_generated(events: list[Any]) -> None:
    spec = {**SPEC, "workerTokenSecret": {"name": "mine", "key": "k"}}
    kube = FakeKube(pool_body(spec))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.secrets == {} and kube.secret_creates == 0
    ref = {"valueFrom": {"secretKeyRef": {"name": "mine", "key": "k"}}}
    assert token_env(kube, "p-colocated") == {"name": "KVFLOW_WORKER_TOKEN", **ref}


def test_a_host_path_outside_the_allowed_folders_is_refused(events: list[Any]) -> None:
    spec = {
        **SPEC,
        "model": {"servedName": "m", "path": "m", "volume": {"hostPath": {"path": "/"}}},
    }
    kube = FakeKube(pool_body(spec))
    reconciler(kube, events).reconcile("ns", "p")
    assert kube.applied == []
    condition = degraded(kube)
    assert condition["reason"] == "HostPathNotAllowed"
    assert "--allowed-host-path-prefix" in condition["message"]
    assert "operator.allowedHostPathPrefixes" in condition["message"]
    # Allowed under /models: /models/../etc is /etc, not under it.
    policy = AdminPolicy(allowed_host_path_prefixes=("/models",))
    for path, allowed in (("/models/llama", True), ("/models/../etc", False), ("/", False)):
        volume = {"hostPath": {"path": path}}
        kube = FakeKube(pool_body({**spec, "model": {**spec["model"], "volume": volume}}))
        reconciler(kube, events, policy).reconcile("ns", "p")
        assert kube.pool is not None
        assert (kube.pool["status"]["phase"] == "Ready") is allowed, path


def test_a_prometheus_url_outside_the_allowed_ones_is_refused(events: list[Any]) -> None:
    source = {"url": "http://169.254.169.254/latest"}
    spec = {**SPEC, "autoscaling": {"prometheus": source}}
    kube = FakeKube(pool_body(spec))
    reconciler(kube, events).reconcile("ns", "p")
    condition = degraded(kube)
    assert condition["reason"] == "PrometheusNotAllowed"
    assert "--allowed-prometheus-url" in condition["message"]
    policy = AdminPolicy(allowed_prometheus_urls=("http://169.254.169.254",))
    kube = FakeKube(pool_body(spec))
    reconciler(kube, events, policy).reconcile("ns", "p")
    assert kube.pool is not None and kube.pool["status"]["phase"] == "Ready"


def audit_events(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    import json

    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvflow.audit"]


def test_what_the_operator_applies_is_audited_once_per_change(
    events: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="kvflow.audit")
    body = pool_body(SPEC)
    body["metadata"]["managedFields"] = [
        {"manager": "kubectl-client-side-apply", "fieldsV1": {"f:spec": {}}},
        {"manager": FIELD_MANAGER, "fieldsV1": {"f:status": {}}},
    ]
    kube = FakeKube(body)
    r = reconciler(kube, events)
    r.reconcile("ns", "p")
    (first,) = audit_events(caplog)
    assert first["event"] == "pool_applied" and (first["namespace"], first["pool"]) == ("ns", "p")
    assert first["spec_written_by"] == ["kubectl-client-side-apply"]
    assert first["tenants_secret"] == "tenants" and first["allow_unauthenticated"] is False
    assert first["worker_token_secret"] == "p-worker-token"
    assert "created Secret p-worker-token" in first["changes"]
    assert "created Deployment p-router" in " ".join(first["changes"])
    token = kube.secrets["p-worker-token"]["data"]["token"]
    assert token not in caplog.text  # names only, never a Secret's contents
    # Nothing changed: nothing audited.
    caplog.clear()
    r.reconcile("ns", "p")
    assert audit_events(caplog) == []
    # The tenants Secret swapped: the routers change, and the trail says so.
    assert kube.pool is not None
    kube.pool["spec"]["router"] = {"tenantsSecret": {"name": "tenants-v2", "key": "t.yaml"}}
    kube.pool["metadata"]["generation"] = 2
    r.reconcile("ns", "p")
    (second,) = audit_events(caplog)
    assert second["generation"] == 2 and second["tenants_secret"] == "tenants-v2"
    assert any("updated" in change and "p-router" in change for change in second["changes"])
