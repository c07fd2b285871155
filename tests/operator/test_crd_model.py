"""The generated CRD: committed copies current, and every field documented."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.crd import all_crds, inference_pool_crd
from kvflow.operator.api.v1alpha1_embedding import EMBED_RULES

REPO = Path(__file__).resolve().parents[2]


def load_generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_crds", REPO / "tools" / "k8s" / "gen_crds.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_crds_are_fresh() -> None:
    assert load_generator().main(["--check"]) == 0, "run `make crds`"


def walk(schema: dict[str, Any], path: str) -> list[str]:
    """Paths of properties without a description (kubectl explain would show nothing)."""
    missing = []
    for name, prop in schema.get("properties", {}).items():
        here = f"{path}.{name}"
        if not prop.get("description") and name not in ("apiVersion", "kind", "metadata"):
            missing.append(here)
        missing += walk(prop, here)
        if "items" in prop:
            missing += walk(prop["items"], here + "[]")
    return missing


def test_every_field_is_described_and_the_crd_is_wired() -> None:
    crd = inference_pool_crd()
    (version,) = crd["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    assert walk(root, "") == []
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["kvpool"]
    assert crd["metadata"]["name"] == f"{v1alpha1.PLURAL}.{v1alpha1.GROUP}"
    spec = root["properties"]["spec"]
    assert [r["message"] for r in spec["x-kubernetes-validations"]] == [
        "mode disaggregated needs both prefill and decode",
        "kvTransport nccl needs gpusPerPod > 0 on both prefill and decode",
        "kvTransport auto needs prefill and decode both on GPUs or both on CPUs "
        "(it picks nccl on GPUs, tcp on CPUs)",
        "router.tenantsSecret is required (the gateway's tenants and API keys); set "
        "router.allowUnauthenticated: true to serve without authentication",
        "router.allowUnauthenticated needs serviceType ClusterIP: an unauthenticated "
        "gateway is never exposed outside the cluster",
        *(rule.message for rule in EMBED_RULES),
    ]
    role = spec["properties"]["colocated"]
    assert role["default"] == {
        "replicas": 1,
        "minReplicas": 0,
        "maxReplicas": 8,
        "gpusPerPod": 0,
        "externalAutoscaler": False,
    }
    status = root["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert set(status) >= {"phase", "conditions", "observedGeneration", "roles", "planner"}


def test_gateway_and_model_crds_are_described_and_validated() -> None:
    crds = {c["spec"]["names"]["kind"]: c for c in all_crds()}
    assert sorted(crds) == ["InferenceGateway", "InferenceModel", "InferencePool"]
    for kind in ("InferenceGateway", "InferenceModel"):
        (version,) = crds[kind]["spec"]["versions"]
        assert walk(version["schema"]["openAPIV3Schema"], "") == [], kind
        assert version["subresources"] == {"status": {}}
    (model,) = crds["InferenceModel"]["spec"]["versions"]
    spec = model["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["gatewayRef", "targets"]
    targets = spec["properties"]["targets"]
    assert targets["minItems"] == 1
    assert targets["items"]["properties"]["weight"]["minimum"] == 0
    assert spec["properties"]["aliases"]["x-kubernetes-list-type"] == "set"
    (gateway,) = crds["InferenceGateway"]["spec"]["versions"]
    router = gateway["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    # The same RouterSpec as a pool's router.
    assert set(router["properties"]) >= {"replicas", "image", "redis", "tenantsSecret", "admission"}
