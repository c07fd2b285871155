"""A real `kvflow operator` (with the chart's RBAC) against the real API server.

Pods never run on KWOK nodes, but KWOK marks them Running and Ready, so Deployments report
ready replicas and the pool's status goes Ready exactly as on a cluster.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from k8s.controlplane import ControlPlane
from k8s.operator_process import DRIFT_INTERVAL_S, WORKER_IMAGE, OperatorProcess
from k8s.pools import (
    CONVERGE_S,
    SMALL_SPEC,
    apply_pool,
    child_names,
    children,
    condition,
    event_reasons,
    get_pool,
    wait_ready,
)
from k8s.support import wait_for

KINDS = ("deployments", "services", "configmaps", "poddisruptionbudgets", "networkpolicies")


def names_by_kind(cluster: ControlPlane, namespace: str, pool: str) -> dict[str, list[str]]:
    return {kind: child_names(cluster, namespace, pool, kind) for kind in KINDS}


COLOCATED_CHILDREN = {
    "deployments": ["smol-colocated", "smol-router"],
    "services": ["smol-gateway", "smol-workers"],
    "configmaps": ["smol-router"],
    "poddisruptionbudgets": ["smol-colocated", "smol-router"],
    "networkpolicies": ["smol-router", "smol-workers"],
}


def test_valid_pool_gets_children_and_a_ready_status(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", SMALL_SPEC)
    pool = wait_ready(cluster, namespace, "smol")

    assert names_by_kind(cluster, namespace, "smol") == COLOCATED_CHILDREN
    uid = pool["metadata"]["uid"]
    for kind in KINDS:
        for child in children(cluster, namespace, "smol", kind):
            (owner,) = child["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"], owner["controller"]) == (
                "InferencePool",
                uid,
                True,
            )

    status = pool["status"]
    assert status["readyReplicas"] == 2 and status["desiredReplicas"] == 2
    assert status["gatewayEndpoint"] == f"http://smol-gateway.{namespace}.svc/v1"
    assert {r["name"]: (r["desiredReplicas"], r["readyReplicas"]) for r in status["roles"]} == {
        "colocated": (2, 2),
        "router": (1, 1),
    }
    assert condition(pool, "Ready")["status"] == "True"
    assert condition(pool, "Ready")["reason"] == "AllReplicasReady"
    assert condition(pool, "Degraded")["status"] == "False"
    assert condition(pool, "SLOMet")["status"] == "Unknown"

    worker = cluster.kubectl_json("get", "deployment", "smol-colocated", "-n", namespace)
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == WORKER_IMAGE
    assert container["args"][:3] == ["worker", "--served-model-name", "smollm2-135m-instruct"]
    assert "--simulate" in container["args"]
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "kvflow.io/role=colocated")
    assert [p["status"]["phase"] for p in pods["items"]] == ["Running", "Running"]

    reasons = event_reasons(cluster, namespace, "smol")
    # 9 children and the generated worker token Secret.
    assert reasons.count("Created") == 10 and "Ready" in reasons
    printed = cluster.kubectl("get", "kvpool", "smol", "-n", namespace).stdout
    assert "Ready" in printed and "colocated" in printed


def test_scaling_changes_replicas_and_status(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", SMALL_SPEC)
    wait_ready(cluster, namespace, "smol")
    cluster.kubectl(
        "patch", "kvpool", "smol", "-n", namespace, "--type", "merge",
        "-p", json.dumps({"spec": {"colocated": {"replicas": 4}, "router": {"replicas": 2}}}),
    )  # fmt: skip
    pool = wait_ready(cluster, namespace, "smol")
    assert pool["status"]["readyReplicas"] == 4
    deployments = {
        d["metadata"]["name"]: d["spec"]["replicas"]
        for d in children(cluster, namespace, "smol", "deployments")
    }
    assert deployments == {"smol-colocated": 4, "smol-router": 2}

    cluster.kubectl(
        "patch", "kvpool", "smol", "-n", namespace, "--type", "merge",
        "-p", json.dumps({"spec": {"colocated": {"replicas": 1}}}),
    )  # fmt: skip
    pool = wait_ready(cluster, namespace, "smol")
    assert pool["status"]["readyReplicas"] == 1
    wait_for(
        lambda: len(cluster.kubectl_json(
            "get", "pods", "-n", namespace, "-l", "kvflow.io/role=colocated")["items"]) == 1,
        CONVERGE_S, "scaled-down pods to go",
    )  # fmt: skip


def test_spec_change_rolls_out_and_mode_switch_replaces_roles(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", SMALL_SPEC)
    before = wait_ready(cluster, namespace, "smol")
    spec = copy.deepcopy(SMALL_SPEC)
    spec["engine"]["maxNumSeqs"] = 7
    apply_pool(cluster, namespace, "smol", spec)
    after = wait_ready(cluster, namespace, "smol")
    assert after["status"]["observedGeneration"] == before["metadata"]["generation"] + 1
    worker = cluster.kubectl_json("get", "deployment", "smol-colocated", "-n", namespace)
    args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "7"
    assert worker["status"]["updatedReplicas"] == 2  # the new template rolled out

    spec["mode"] = "disaggregated"
    spec["prefill"] = {"replicas": 1}
    spec["decode"] = {"replicas": 2}
    apply_pool(cluster, namespace, "smol", spec)
    pool = wait_ready(cluster, namespace, "smol")
    assert names_by_kind(cluster, namespace, "smol") == {
        "deployments": ["smol-decode", "smol-prefill", "smol-router"],
        "services": ["smol-gateway", "smol-workers"],
        "configmaps": ["smol-router"],
        "poddisruptionbudgets": ["smol-decode", "smol-prefill", "smol-router"],
        "networkpolicies": ["smol-router", "smol-workers"],
    }
    assert pool["status"]["readyReplicas"] == 3
    decode = cluster.kubectl_json("get", "deployment", "smol-decode", "-n", namespace)
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--role") + 1] == "decode"
    assert "Deleted" in event_reasons(cluster, namespace, "smol")


def test_disaggregated_status_tells_whether_the_pool_can_serve(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    spec = {
        **SMALL_SPEC,
        "mode": "disaggregated",
        "prefill": {"replicas": 1, "minReplicas": 0},
        "decode": {"replicas": 1, "minReplicas": 0},
    }
    apply_pool(cluster, namespace, "pd", spec)
    wait_ready(cluster, namespace, "pd")

    def settled(reason: str) -> dict[str, Any] | None:
        pool = get_pool(cluster, namespace, "pd")
        current = pool["status"].get("observedGeneration") == pool["metadata"]["generation"]
        degraded = condition(pool, "Degraded")
        return pool if current and degraded["reason"] == reason else None

    # No decode worker: prefill workers cannot serve alone, so the pool is not Ready.
    apply_pool(cluster, namespace, "pd", {**spec, "decode": {"replicas": 0, "minReplicas": 0}})
    pool = wait_for(lambda: settled("NoDecodeWorkerReady"), CONVERGE_S, "NoDecodeWorkerReady")
    assert pool["status"]["phase"] == "Degraded"
    assert (condition(pool, "Ready")["status"], condition(pool, "Ready")["reason"]) == (
        "False",
        "NoDecodeWorkerReady",
    )

    # No prefill worker: decode workers prefill themselves; it serves, degraded.
    apply_pool(cluster, namespace, "pd", {**spec, "prefill": {"replicas": 0, "minReplicas": 0}})
    pool = wait_for(lambda: settled("NoPrefillWorkerReady"), CONVERGE_S, "NoPrefillWorkerReady")
    assert pool["status"]["phase"] == "Degraded"
    assert condition(pool, "Ready")["status"] == "True"
    assert (
        "decode workers prefill every prompt themselves" in condition(pool, "Degraded")["message"]
    )


def test_drift_is_repaired(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", SMALL_SPEC)
    wait_ready(cluster, namespace, "smol")
    old_uid = cluster.kubectl_json("get", "deployment", "smol-colocated", "-n", namespace)[
        "metadata"
    ]["uid"]

    cluster.kubectl("delete", "deployment", "smol-colocated", "-n", namespace)
    cluster.kubectl("delete", "service", "smol-gateway", "-n", namespace)
    cluster.kubectl("delete", "configmap", "smol-router", "-n", namespace)
    cluster.kubectl("scale", "deployment", "smol-router", "-n", namespace, "--replicas", "5")

    wait_for(
        lambda: names_by_kind(cluster, namespace, "smol") == COLOCATED_CHILDREN,
        DRIFT_INTERVAL_S * 10 + 30,
        "deleted children to come back",
    )
    new = cluster.kubectl_json("get", "deployment", "smol-colocated", "-n", namespace)
    assert new["metadata"]["uid"] != old_uid  # recreated, not a leftover
    wait_for(
        lambda: (
            cluster.kubectl_json("get", "deployment", "smol-router", "-n", namespace)["spec"][
                "replicas"
            ]
            == 1
        ),
        DRIFT_INTERVAL_S * 10 + 30,
        "hand-scaled router to return to 1 replica",
    )
    wait_ready(cluster, namespace, "smol")
    operator.assert_alive()


def test_spec_the_schema_cannot_judge_is_reported_in_status(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    spec = copy.deepcopy(SMALL_SPEC)
    spec["colocated"]["resources"] = {"requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}
    apply_pool(cluster, namespace, "smol", spec)

    def degraded() -> dict[str, object] | None:
        pool = get_pool(cluster, namespace, "smol")
        return pool if pool.get("status", {}).get("phase") == "Degraded" else None

    pool = wait_for(degraded, CONVERGE_S, "pool to be Degraded")
    assert condition(pool, "Degraded")["reason"] == "InvalidSpec"
    assert (
        "requests.memory (4Gi) exceeds limits.memory (2Gi)"
        in condition(pool, "Degraded")["message"]
    )
    assert condition(pool, "Ready")["status"] == "False"
    assert child_names(cluster, namespace, "smol", "deployments") == []  # nothing half-built
    assert "Degraded" in event_reasons(cluster, namespace, "smol")

    # A child the API server refuses (a label key the CRD cannot check) is reported too.
    spec["colocated"]["resources"] = {}
    spec["colocated"]["nodeSelector"] = {"not a/valid/key": "x"}
    apply_pool(cluster, namespace, "smol", spec)

    def rejected() -> dict[str, object] | None:
        pool = get_pool(cluster, namespace, "smol")
        return pool if condition(pool, "Degraded")["reason"] == "ApplyRejected" else None

    pool = wait_for(rejected, CONVERGE_S, "the rejected Deployment to be reported")
    assert "Deployment smol-colocated" in condition(pool, "Degraded")["message"]
    operator.assert_alive()

    spec["colocated"]["nodeSelector"] = {}
    apply_pool(cluster, namespace, "smol", spec)
    wait_ready(cluster, namespace, "smol")


def test_deleting_the_pool_garbage_collects_its_children(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply_pool(cluster, namespace, "smol", SMALL_SPEC)
    wait_ready(cluster, namespace, "smol")
    cluster.kubectl("delete", "kvpool", "smol", "-n", namespace, "--wait=true", "--timeout=60s")

    def all_gone() -> bool:
        left = {kind: child_names(cluster, namespace, "smol", kind) for kind in (*KINDS, "pods")}
        return not any(left.values())

    wait_for(all_gone, CONVERGE_S, "the controller-manager to collect the pool's children")
    operator.assert_alive()


def test_an_operator_limited_to_namespaces_leaves_others_alone(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path: Path, namespace: str
) -> None:
    other = f"{namespace}-other"[:63]
    cluster.kubectl("create", "namespace", other)
    op = OperatorProcess(
        cluster, operator_kubeconfig, tmp_path, "op-scoped", extra_args=("--namespace", namespace)
    )
    op.start()
    try:
        apply_pool(cluster, other, "ignored", SMALL_SPEC)
        apply_pool(cluster, namespace, "smol", SMALL_SPEC)
        wait_ready(cluster, namespace, "smol")
        time.sleep(DRIFT_INTERVAL_S * 2)  # a sweep or two has run
        assert child_names(cluster, other, "ignored", "deployments") == []
        assert "status" not in get_pool(cluster, other, "ignored")
    finally:
        op.stop()
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
