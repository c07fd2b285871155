"""Secure by default, on the real API server with the real operator: no gateway without
tenants unless it says so (and then never outside the cluster), a worker token for every
pool, and no node folder the operator's administrator did not allow."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s.controlplane import CHART, SYSTEM_NAMESPACE, ControlPlane
from k8s.operator_process import DRIFT_INTERVAL_S, OperatorProcess
from k8s.pools import CONVERGE_S, SMALL_SPEC, apply_pool, condition, get_pool, wait_ready
from k8s.support import wait_for, write_kubeconfig

TENANTS = {"tenantsSecret": {"name": "tenants", "key": "tenants.yaml"}}


def dry_run(cluster: ControlPlane, namespace: str, kind: str, spec: dict[str, Any]) -> Any:
    """The raw object (no test defaults): what a user's `kubectl apply` sends."""
    manifest = {
        "apiVersion": "kvflow.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": namespace},
        "spec": spec,
    }
    return cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False
    )


POOL = {"model": {"servedName": "m"}}
# (spec, what the API server answers; "" for accepted)
AUTH_CASES: list[tuple[dict[str, Any], str]] = [
    (POOL, "router.tenantsSecret is required"),
    ({**POOL, "router": {"allowUnauthenticated": False}}, "router.tenantsSecret is required"),
    ({**POOL, "router": TENANTS}, ""),
    ({**POOL, "router": {"allowUnauthenticated": True}}, ""),
    (
        {**POOL, "router": {"allowUnauthenticated": True, "serviceType": "LoadBalancer"}},
        "router.allowUnauthenticated needs serviceType ClusterIP",
    ),
    (
        {**POOL, "router": {"allowUnauthenticated": True, "serviceType": "NodePort"}},
        "router.allowUnauthenticated needs serviceType ClusterIP",
    ),
    ({**POOL, "router": {**TENANTS, "serviceType": "LoadBalancer"}}, ""),
]


@pytest.mark.parametrize("kind", ["InferencePool", "InferenceGateway"])
def test_a_gateway_without_tenants_is_refused_unless_it_opts_in_on_clusterip(
    cluster: ControlPlane, crd: str, namespace: str, kind: str
) -> None:
    for pool_spec, message in AUTH_CASES:
        spec = pool_spec
        if kind == "InferenceGateway":
            spec = {k: v for k, v in pool_spec.items() if k == "router"}
        out = dry_run(cluster, namespace, kind, spec)
        if not message:
            assert out.returncode == 0, (spec, out.stderr)
        else:
            assert out.returncode != 0, spec
            assert message in out.stderr, (spec, out.stderr)


def secret(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", "secret", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def token_refs(cluster: ControlPlane, namespace: str, deployment: str) -> list[Any]:
    got = cluster.kubectl_json("get", "deployment", deployment, "-n", namespace)
    (container,) = got["spec"]["template"]["spec"]["containers"]
    return [e["valueFrom"] for e in container["env"] if e["name"] == "KVFLOW_WORKER_TOKEN"]


def test_the_operator_makes_each_pool_a_worker_token_once(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", {**SMALL_SPEC, "router": TENANTS})
    pool = wait_ready(cluster, namespace, "smol")
    created = secret(cluster, namespace, "smol-worker-token")
    assert created is not None
    (owner,) = created["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("InferencePool", pool["metadata"]["uid"])
    assert set(created["data"]) == {"token"}
    wired = [{"secretKeyRef": {"name": "smol-worker-token", "key": "token"}}]
    for deployment in ("smol-colocated", "smol-router"):
        assert token_refs(cluster, namespace, deployment) == wired, deployment
    # Drift sweeps (every DRIFT_INTERVAL_S) and a spec edit re-reconcile: the Secret is
    # never written again, so running pods keep agreeing on the token.
    cluster.kubectl(
        "patch", "inferencepool", "smol", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"colocated": {"replicas": 3}}}),
    )  # fmt: skip
    wait_ready(cluster, namespace, "smol")
    time.sleep(3 * DRIFT_INTERVAL_S)
    after = secret(cluster, namespace, "smol-worker-token")
    assert after is not None and after["data"] == created["data"]
    assert after["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    # Never logged.
    token = created["data"]["token"]
    assert token not in operator.log()
    assert base64.b64decode(token).decode() not in operator.log()
    # The pool owns it: deleting the pool collects it.
    cluster.kubectl("delete", "inferencepool", "smol", "-n", namespace)
    wait_for(
        lambda: secret(cluster, namespace, "smol-worker-token") is None,
        CONVERGE_S,
        "the worker token Secret to be garbage-collected with its pool",
    )


def test_a_users_worker_token_is_wired_and_none_is_made(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    ref = {"name": "mine", "key": "t"}
    apply_pool(cluster, namespace, "smol", {**SMALL_SPEC, "router": TENANTS,
                                            "workerTokenSecret": ref})  # fmt: skip
    wait_ready(cluster, namespace, "smol")
    for deployment in ("smol-colocated", "smol-router"):
        assert token_refs(cluster, namespace, deployment) == [{"secretKeyRef": ref}]
    assert secret(cluster, namespace, "smol-worker-token") is None


def wait_degraded(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    def degraded() -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, name)
        return pool if pool.get("status", {}).get("phase") == "Degraded" else None

    found: dict[str, Any] = wait_for(degraded, CONVERGE_S, f"pool {name} Degraded")
    return found


HOST_PATH_SPEC = {
    **SMALL_SPEC,
    "router": TENANTS,
    "model": {"servedName": "m", "path": "llama", "volume": {"hostPath": {"path": "/"}}},
}


def test_a_host_path_outside_the_allowed_folders_is_refused(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "nodefs", HOST_PATH_SPEC)
    pool = wait_degraded(cluster, namespace, "nodefs")
    degraded = condition(pool, "Degraded")
    assert degraded["reason"] == "HostPathNotAllowed", degraded
    assert (
        "model.volume.hostPath / is not under a folder the operator allows" in (degraded["message"])
    )
    assert "--allowed-host-path-prefix" in degraded["message"]
    listed = cluster.kubectl_json("get", "deployments", "-n", namespace)["items"]
    assert listed == []  # nothing mounts the node's root


@pytest.fixture()
def models_operator(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(
        cluster, operator_kubeconfig, tmp_path, identity="op-models",
        extra_args=("--allowed-host-path-prefix", "/models"),
    )  # fmt: skip
    proc.start()
    yield proc
    proc.stop()


def test_a_host_path_under_an_allowed_folder_is_mounted(
    cluster: ControlPlane, models_operator: OperatorProcess, namespace: str
) -> None:
    volume = {"hostPath": {"path": "/models/llama"}}
    spec = {**HOST_PATH_SPEC, "model": {**HOST_PATH_SPEC["model"], "volume": volume}}
    apply_pool(cluster, namespace, "nodefs", spec)
    wait_ready(cluster, namespace, "nodefs")
    got = cluster.kubectl_json("get", "deployment", "nodefs-colocated", "-n", namespace)
    volumes = got["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/models/llama", "type": "Directory"}} in volumes


def test_an_operator_with_only_namespaced_roles_reconciles_its_namespace(
    cluster: ControlPlane, chart_release: str, namespace: str, tmp_path: Path
) -> None:
    """A second release of the chart with operator.watchNamespaces (no operator pods):
    the operator run with its ServiceAccount's token, which holds a Role in `namespace` and
    a ClusterRole for CRDs only, serves a pool there and can do nothing elsewhere."""
    release = "kvflow-ns"  # fullname kvflow-ns: ServiceAccount kvflow-ns-operator
    cluster.helm(
        "install", release, str(CHART), "--namespace", SYSTEM_NAMESPACE,
        "--set", f"operator.watchNamespaces={{{namespace}}}", "--set", "operator.replicas=0",
    )  # fmt: skip
    try:
        account = f"system:serviceaccount:{SYSTEM_NAMESPACE}:{release}-operator"
        for verb, resource, where, allowed in (
            ("patch", "deployments", ["-n", namespace], "yes"),
            ("create", "secrets", ["-n", namespace], "yes"),
            ("get", "secrets", ["-n", namespace], "no"),
            ("patch", "deployments", ["-n", "default"], "no"),
            ("list", "inferencepools", ["-A"], "no"),
            ("watch", "customresourcedefinitions", [], "yes"),
        ):
            out = cluster.kubectl(
                "auth", "can-i", verb, resource, "--as", account, *where, check=False
            )
            assert out.stdout.strip() == allowed, (verb, resource, where, out.stdout)
        token = cluster.kubectl(
            "create", "token", f"{release}-operator", "-n", SYSTEM_NAMESPACE
        ).stdout.strip()
        kubeconfig = write_kubeconfig(
            tmp_path / "ns.kubeconfig", cluster.server, cluster.workdir / "pki" / "ca.crt",
            token, f"{release}-operator",
        )  # fmt: skip
        proc = OperatorProcess(
            cluster, kubeconfig, tmp_path, identity="op-ns",
            lease_name=f"{release}-operator",
            extra_args=("--namespace", namespace),
        )  # fmt: skip
        proc.start()
        try:
            apply_pool(cluster, namespace, "smol", {**SMALL_SPEC, "router": TENANTS})
            wait_ready(cluster, namespace, "smol")
            assert secret(cluster, namespace, "smol-worker-token") is not None
            assert "Forbidden" not in proc.log(), proc.log()[-3000:]
        finally:
            proc.stop()
    finally:
        cluster.helm("uninstall", release, "--namespace", SYSTEM_NAMESPACE, check=False)


def metrics_rules(cluster: ControlPlane, namespace: str, name: str, port: int) -> list[Any] | None:
    """The ingress rules of NetworkPolicy `name` that open `port` (None: no such policy)."""
    out = cluster.kubectl("get", "networkpolicy", name, "-n", namespace, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    got = json.loads(out.stdout)
    return [r for r in got["spec"]["ingress"]
            if {"protocol": "TCP", "port": port} in r.get("ports", [])]  # fmt: skip


def test_the_metrics_ports_admit_the_named_namespaces_and_an_upgrade_closes_them(
    cluster: ControlPlane, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    """An operator that opens the metrics ports to every pod (`'*'`, what every operator
    did before the setting), then the default one naming Prometheus' namespace: the pools'
    NetworkPolicies, applied server-side, lose the open rule (a rule list is replaced
    whole), and the API server accepts the namespace selectors."""
    open_port = {"ports": [{"protocol": "TCP", "port": 9400}]}
    for folder in ("open", "scoped"):
        (tmp_path / folder).mkdir()
    before = OperatorProcess(cluster, operator_kubeconfig, tmp_path / "open", identity="op-open",
                             extra_args=("--metrics-scraper-namespace", "*"))  # fmt: skip
    before.start()
    try:
        apply_pool(cluster, namespace, "scraped", {**SMALL_SPEC, "router": TENANTS})
        wait_for(lambda: metrics_rules(cluster, namespace, "scraped-workers", 9400) == [open_port],
                 CONVERGE_S, "the workers' metrics port open to every pod")  # fmt: skip
    finally:
        before.stop()
    after = OperatorProcess(cluster, operator_kubeconfig, tmp_path / "scoped", identity="op-scoped",
                            extra_args=("--metrics-scraper-namespace", "monitoring"))  # fmt: skip
    after.start()
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {},
    }
    try:
        for policy, port in (("scraped-workers", 9400), ("scraped-router", 9401)):
            scoped = [{"from": [monitoring], "ports": [{"protocol": "TCP", "port": port}]}]
            wait_for(
                lambda p=policy, n=port, w=scoped: metrics_rules(cluster, namespace, p, n) == w,
                CONVERGE_S,
                f"{policy}: port {port} from monitoring only",
            )
        # The router's API port still takes requests from anywhere.
        assert metrics_rules(cluster, namespace, "scraped-router", 8000) == [
            {"ports": [{"protocol": "TCP", "port": 8000}]}
        ]
    finally:
        after.stop()
