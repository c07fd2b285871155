"""The InferencePool CRD in a real API server, through the real kubectl."""

from __future__ import annotations

import json
from typing import Any

import pytest
from k8s.controlplane import ControlPlane
from k8s.pools import pool_manifest


def dry_run(cluster: ControlPlane, namespace: str, name: str, spec: dict[str, Any]) -> Any:
    return cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-",
        input=pool_manifest(namespace, name, spec), check=False,
    )  # fmt: skip


def test_crd_is_established_with_short_name_and_printer_columns(
    cluster: ControlPlane, crd: str
) -> None:
    resources = cluster.kubectl("api-resources", "--api-group=kvflow.io", "-o", "wide").stdout
    assert "inferencepools" in resources and "kvpool" in resources and "InferencePool" in resources
    crd_obj = cluster.kubectl_json("get", "crd", crd)
    (version,) = crd_obj["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Mode", "Model", "Ready", "Desired", "Gateway", "Age",
    ]  # fmt: skip


def test_kubectl_explain_teaches_the_fields(cluster: ControlPlane, crd: str) -> None:
    out = cluster.kubectl("explain", "inferencepool.spec.engine.kvCacheGiB").stdout
    assert "Memory given to the paged KV cache per worker, in GiB." in out
    out = cluster.kubectl("explain", "inferencepool.spec.mode").stdout
    assert "disaggregated" in out and "colocated" in out


def test_defaults_are_filled_in_by_the_api_server(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    out = dry_run(cluster, namespace, "defaults", {"model": {"servedName": "m"}})
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)["spec"]
    assert spec["mode"] == "colocated"
    assert spec["kvTransport"] == "auto"
    assert spec["colocated"] == {
        "replicas": 1,
        "minReplicas": 0,
        "maxReplicas": 8,
        "externalAutoscaler": False,
        "gpusPerPod": 0,
        "resources": {},
    }
    assert spec["engine"]["blockSize"] == 16
    # Unset: 1 GiB on a CPU worker, what --gpu-memory-utilization leaves on a GPU one.
    assert "kvCacheGiB" not in spec["engine"]
    assert spec["engine"]["gpuMemoryUtilization"] == 0.9
    assert spec["engine"]["kvCacheDtype"] == "auto"
    assert spec["router"]["scorerWeights"] == {}  # unset: the router's time-based scorer
    assert spec["slo"] == {"ttftTargetMs": 1000, "tpotTargetMs": 100, "percentile": 90}
    assert "prefill" not in spec and "decode" not in spec


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        (
            "replicas-above-max",
            {"model": {"servedName": "m"}, "colocated": {"replicas": 9, "maxReplicas": 4}},
            "spec.colocated.replicas: Invalid value: replicas must lie within "
            "[minReplicas, maxReplicas]",
        ),
        (
            "min-above-max",
            {
                "model": {"servedName": "m"},
                "colocated": {"replicas": 2, "minReplicas": 3, "maxReplicas": 2},
            },
            "minReplicas must not exceed maxReplicas",
        ),
        (
            "pd-without-roles",
            {"model": {"servedName": "m"}, "mode": "disaggregated"},
            "mode disaggregated needs both prefill and decode",
        ),
        (
            "nccl-on-cpu",
            {
                "model": {"servedName": "m"},
                "mode": "disaggregated",
                "prefill": {},
                "decode": {"gpusPerPod": 1},
                "kvTransport": "nccl",
            },
            "kvTransport nccl needs gpusPerPod > 0 on both prefill and decode",
        ),
        (
            "auto-on-mixed-devices",
            {
                "model": {"servedName": "m"},
                "mode": "disaggregated",
                "prefill": {"gpusPerPod": 1},
                "decode": {},
            },
            "kvTransport auto needs prefill and decode both on GPUs or both on CPUs",
        ),
        (
            "unknown-mode",
            {"model": {"servedName": "m"}, "mode": "pipelined"},
            'spec.mode: Unsupported value: "pipelined"',
        ),
        ("no-model", {"engine": {}}, "spec.model: Required value"),
        (
            "two-volumes",
            {
                "model": {
                    "servedName": "m",
                    "path": "llama",
                    "volume": {
                        "hostPath": {"path": "/m"},
                        "persistentVolumeClaim": {"claimName": "c"},
                    },
                }
            },
            "model.volume needs exactly one of persistentVolumeClaim or hostPath",
        ),
        (
            "absolute-path-in-volume",
            {
                "model": {
                    "servedName": "m",
                    "path": "/llama",
                    "volume": {"persistentVolumeClaim": {"claimName": "c"}},
                }
            },
            "model.path must be a path relative to model.volume when a volume is set",
        ),
        (
            "tiny-budget",
            {"model": {"servedName": "m"}, "engine": {"blockSize": 32, "maxNumBatchedTokens": 16}},
            "engine.maxNumBatchedTokens must be at least engine.blockSize",
        ),
        (
            "zero-kv-cache",
            {"model": {"servedName": "m"}, "engine": {"kvCacheGiB": 0}},
            "spec.engine.kvCacheGiB: Invalid value: 0",
        ),
        (
            "admission-shed-over-max",
            {"model": {"servedName": "m"}, "router": {"admission": {"maxQueueTimeSeconds": 5}}},
            "router.admission.shedQueueTimeSeconds (default 10) must be at most",
        ),
        (
            "admission-zero-poll",
            {"model": {"servedName": "m"}, "router": {"admission": {"pollIntervalSeconds": 0}}},
            "spec.router.admission.pollIntervalSeconds: Invalid value: 0",
        ),
        (
            "utilization-too-hot",
            {"model": {"servedName": "m"}, "autoscaling": {"targetUtilization": 0.99}},
            "spec.autoscaling.targetUtilization in body should be less than or equal to 0.95",
        ),
        (
            "calm-gate-at-the-target",
            {"model": {"servedName": "m"}, "autoscaling": {"scaleDownLatencyRatio": 0.99}},
            "spec.autoscaling.scaleDownLatencyRatio in body should be less than or equal to 0.95",
        ),
        (
            "9starts-with-digit",
            {"model": {"servedName": "m"}},
            "an InferencePool name must start with a letter",
        ),
    ],
)
def test_invalid_pool_is_rejected_with_the_schemas_message(
    cluster: ControlPlane, crd: str, namespace: str, name: str, spec: dict[str, Any], message: str
) -> None:
    out = dry_run(cluster, namespace, name, spec)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
