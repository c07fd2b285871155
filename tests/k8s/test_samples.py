"""The sample pools are valid and reconcile to Ready (the GPU one onto a fake GPU node)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from k8s.controlplane import REPO, ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pools import child_names, wait_ready

from kvflow.router.tenants.config import parse_tenants

ALL_SAMPLES = sorted((REPO / "samples").glob("*.yaml"))
# One InferencePool each (its tenants Secret beside it); the gateway sample (several
# pools) is tests/k8s/test_gateway.py's.
SAMPLES = [
    path
    for path in ALL_SAMPLES
    if [d.get("kind") for d in yaml.safe_load_all(path.read_text()) if d]
    in (["InferencePool"], ["Secret", "InferencePool"])
]


@pytest.mark.parametrize("sample", ALL_SAMPLES, ids=[s.stem for s in ALL_SAMPLES])
def test_every_sample_gateway_has_tenants_the_router_reads(sample: Any) -> None:
    """Secure by default: no sample opens a gateway; the tenants it ships parse."""
    docs = [d for d in yaml.safe_load_all(sample.read_text()) if d]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    routers = [
        d["spec"]["router"] for d in docs if d["kind"] in ("InferencePool", "InferenceGateway")
    ]
    assert routers
    for router in routers:
        assert "allowUnauthenticated" not in router
        ref = router["tenantsSecret"]
        if ref["name"] in secrets:  # shipped beside it (else a prerequisite it names)
            text = secrets[ref["name"]]["stringData"][ref["key"]]
            directory = parse_tenants(yaml.safe_load(text)["tenants"])
            assert not directory.is_open
            assert directory.lookup("demo-key-change-me") is not None  # as its comment says
        else:
            assert ref["name"] in sample.read_text().split("apiVersion")[0], ref


def pv_and_claim(namespace: str) -> list[dict[str, Any]]:
    """A hostPath volume bound to the claim the GPU sample names (the scheduler will not
    place a pod whose claim is unbound)."""
    pv_name = f"models-{namespace}"[:63]
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "accessModes": ["ReadOnlyMany"],
                "hostPath": {"path": "/models"},
                "storageClassName": "",
                "claimRef": {"namespace": namespace, "name": "models"},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "100Gi"}},
            },
        },
    ]


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_pool_is_valid_and_becomes_ready(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str, sample: Any
) -> None:
    (pool,) = [
        d for d in yaml.safe_load_all(sample.read_text()) if d and d["kind"] == "InferencePool"
    ]
    name = pool["metadata"]["name"]
    for obj in pv_and_claim(namespace):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    cluster.kubectl("apply", "-n", namespace, "-f", str(sample))
    ready = wait_ready(cluster, namespace, name)

    spec = pool["spec"]
    roles = ["colocated"] if spec.get("mode", "colocated") == "colocated" else ["prefill", "decode"]
    assert child_names(cluster, namespace, name, "deployments") == sorted(
        [f"{name}-{r}" for r in roles] + [f"{name}-router"]
    )
    assert ready["status"]["desiredReplicas"] == sum(spec[r]["replicas"] for r in roles)
    for role in roles:
        gpus = spec[role].get("gpusPerPod", 0)
        pods = cluster.kubectl_json(
            "get", "pods", "-n", namespace, "-l", f"kvflow.io/pool={name},kvflow.io/role={role}"
        )["items"]
        for pod in pods:
            limits = pod["spec"]["containers"][0]["resources"].get("limits", {})
            assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None)
            if gpus:
                assert pod["spec"]["nodeName"] == "kwok-gpu-0"
