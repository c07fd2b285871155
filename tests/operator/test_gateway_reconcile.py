"""A namespace's gateways reconciled against a fake API: which statuses and children follow
from gateways, models and pools (the real API server runs the same in tests/k8s)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from kvflow.operator.builders.desired import ChildKey
from kvflow.operator.builders.names import Images
from kvflow.operator.gateway_reconcile import GatewayReconciler
from kvflow.operator.kube import FIELD_MANAGER

NOW = "2026-01-01T00:00:00Z"


def obj(kind: str, name: str, spec: dict[str, Any], created: str = NOW) -> dict[str, Any]:
    return {
        "apiVersion": "kvflow.io/v1alpha1",
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": created,
        },
        "spec": spec,
    }


class FakeKube:
    def __init__(self) -> None:
        self.custom: dict[str, dict[str, dict[str, Any]]] = {
            "inferencegateways": {}, "inferencemodels": {}, "inferencepools": {},
        }  # fmt: skip
        self.children: dict[tuple[str, str], dict[str, Any]] = {}
        self.deleted: list[str] = []

    def add(self, plural: str, body: dict[str, Any]) -> None:
        self.custom[plural][body["metadata"]["name"]] = body

    def list_objects(self, plural: str, namespaces: list[str]) -> list[Any]:
        return [copy.deepcopy(o) for o in self.custom[plural].values()]

    def list_pool_objects(self, namespaces: list[str]) -> list[Any]:
        return self.list_objects("inferencepools", namespaces)

    def patch_object_status(self, plural: str, namespace: str, name: str, status: Any) -> None:
        self.custom[plural][name]["status"] = copy.deepcopy(status)

    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Any]:
        return [copy.deepcopy(o) for (k, _), o in self.children.items() if k == kind]

    def apply(self, body: dict[str, Any], field_manager: str = FIELD_MANAGER) -> Any:
        stored = copy.deepcopy(body)
        # As the API server does for Deployments: the generation moves when the spec does.
        before = self.children.get((body["kind"], body["metadata"]["name"]))
        same = before is not None and {k: v for k, v in before.items() if k != "status"} == {
            **body,
            "metadata": {**body["metadata"], "generation": before["metadata"]["generation"]},
        }
        stored["metadata"]["generation"] = (
            1 if before is None else (before["metadata"]["generation"] + (0 if same else 1))
        )
        if body["kind"] == "Deployment":
            n = body["spec"]["replicas"]
            generation = stored["metadata"]["generation"]
            stored["status"] = {
                "readyReplicas": n, "updatedReplicas": n, "observedGeneration": generation,
            }  # fmt: skip
        self.children[(body["kind"], body["metadata"]["name"])] = stored
        return copy.deepcopy(stored)

    def delete(self, key: ChildKey, namespace: str) -> None:
        self.deleted.append(str(key))

    def status(self, plural: str, name: str) -> dict[str, Any]:
        status: dict[str, Any] = self.custom[plural][name].get("status", {})
        return status


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def reconciler(kube: FakeKube) -> GatewayReconciler:
    return GatewayReconciler(
        kube=kube,
        images=Images(worker="w:1", router="r:1"),
        post_event=lambda *_: None,
        now=lambda: NOW,
    )


# A gateway needs tenants (or allowUnauthenticated), and the pools behind one gateway a
# shared worker token (each would otherwise have its own generated one).
GATEWAY = {"router": {"tenantsSecret": {"name": "tenants", "key": "tenants.yaml"}}}
SHARED_TOKEN = {"name": "token", "key": "token"}


def pool_spec(served: str) -> dict[str, Any]:
    return {"model": {"servedName": served}, "workerTokenSecret": SHARED_TOKEN}


def model(gateway: str, *pools: str) -> dict[str, Any]:
    return {
        "gatewayRef": {"name": gateway},
        "targets": [{"poolRef": {"name": p}, "weight": 1} for p in pools],
    }


def test_gateway_serves_its_models_and_reports_a_missing_pool() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1", "v2")))
    reconciler(kube).reconcile_namespace("ns")

    gateway = kube.status("inferencegateways", "front")
    assert gateway["phase"] == "Degraded"
    assert conditions(gateway)["Ready"] == ("True", "RoutersReady")  # it serves v1
    assert conditions(gateway)["Degraded"] == ("True", "TargetPoolMissing")
    degraded = next(c for c in gateway["conditions"] if c["type"] == "Degraded")
    assert "target pool v2 does not exist" in degraded["message"]
    assert gateway["endpoint"] == "http://front.ns.svc/v1"
    assert gateway["models"] == [
        {"name": "chat", "aliases": [], "targets": [{"pool": "v1", "weight": 1}], "source": "chat"}
    ]
    assert conditions(kube.status("inferencemodels", "chat")) == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("False", "TargetPoolMissing"),
    }
    config = yaml.safe_load(kube.children[("ConfigMap", "front-gateway")]["data"]["router.yaml"])
    assert [p["name"] for p in config["pools"]] == ["v1"]

    # The missing pool appears: the next reconcile serves both and the gateway is Ready.
    kube.add("inferencepools", obj("InferencePool", "v2", pool_spec("m-v2")))
    reconciler(kube).reconcile_namespace("ns")
    assert kube.status("inferencegateways", "front")["phase"] == "Ready"
    config = yaml.safe_load(kube.children[("ConfigMap", "front-gateway")]["data"]["router.yaml"])
    assert [p["name"] for p in config["pools"]] == ["v1", "v2"]
    assert conditions(kube.status("inferencemodels", "chat"))["ResolvedRefs"][0] == "True"


def test_a_model_whose_gateway_does_not_exist_says_so() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("nowhere", "v1")))
    reconciler(kube).reconcile_namespace("ns")
    assert conditions(kube.status("inferencemodels", "chat"))["Accepted"] == (
        "False",
        "GatewayNotFound",
    )
    assert kube.children == {}


def test_a_gateway_without_models_runs_no_router_and_is_pending() -> None:
    kube = FakeKube()
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    reconciler(kube).reconcile_namespace("ns")
    status = kube.status("inferencegateways", "front")
    assert status["phase"] == "Pending"
    assert conditions(status)["Ready"] == ("False", "NoModels")
    assert kube.children[("Deployment", "front-gateway")]["spec"]["replicas"] == 0


def test_the_older_model_keeps_its_name() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    late = obj("InferenceModel", "a-late", {**model("front", "v1"), "modelName": "chat"},
               created="2026-01-02T00:00:00Z")  # fmt: skip
    kube.add("inferencemodels", late)
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1")))
    reconciler(kube).reconcile_namespace("ns")
    assert conditions(kube.status("inferencemodels", "chat"))["Accepted"][0] == "True"
    assert conditions(kube.status("inferencemodels", "a-late"))["Accepted"] == (
        "False",
        "NameConflict",
    )


def test_a_gateway_status_refresh_claims_no_generation_it_did_not_apply() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1")))
    reconciler(kube).reconcile_namespace("ns")
    assert kube.status("inferencegateways", "front")["observedGeneration"] == 1
    front = kube.custom["inferencegateways"]["front"]
    front["spec"] = {"router": {**GATEWAY["router"], "replicas": 3}}
    front["metadata"]["generation"] = 2
    reconciler(kube).reconcile_namespace("ns", apply=False)  # its Deployment moved first
    assert kube.children[("Deployment", "front-gateway")]["spec"]["replicas"] != 3
    assert kube.status("inferencegateways", "front")["observedGeneration"] == 1
    reconciler(kube).reconcile_namespace("ns")
    assert kube.children[("Deployment", "front-gateway")]["spec"]["replicas"] == 3
    assert kube.status("inferencegateways", "front")["observedGeneration"] == 2


def test_an_unauthenticated_gateway_is_not_deployed() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", {}))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1")))
    reconciler(kube).reconcile_namespace("ns")
    gateway = kube.status("inferencegateways", "front")
    assert gateway["phase"] == "Degraded"
    assert conditions(gateway)["Degraded"] == ("True", "Unauthenticated")
    assert kube.children == {}


def test_a_gateway_mounts_no_host_path_the_operator_does_not_allow() -> None:
    kube = FakeKube()
    volume = {"hostPath": {"path": "/var/lib"}}
    spec = {**pool_spec("m-v1"), "model": {"servedName": "m", "path": "x", "volume": volume}}
    kube.add("inferencepools", obj("InferencePool", "v1", spec))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1")))
    reconciler(kube).reconcile_namespace("ns")
    gateway = kube.status("inferencegateways", "front")
    assert conditions(gateway)["Degraded"] == ("True", "HostPathNotAllowed")
    assert kube.children == {}


def test_what_a_gateway_applies_is_audited_with_its_model_routing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import json

    caplog.set_level("INFO", logger="kvflow.audit")

    def audited() -> list[dict[str, Any]]:
        found = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvflow.audit"]
        caplog.clear()
        return found

    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1", "v2")))
    reconciler(kube).reconcile_namespace("ns")
    (first,) = audited()
    assert (first["event"], first["gateway"], first["tenants_secret"]) == (
        "gateway_applied", "front", "tenants",
    )  # fmt: skip
    assert first["models"]["chat"]["targets"] == {"v1": 1}
    reconciler(kube).reconcile_namespace("ns")
    assert audited() == []  # nothing changed
    # The second pool appears: the routing changes, and the trail says where requests go.
    kube.add("inferencepools", obj("InferencePool", "v2", pool_spec("m-v2")))
    reconciler(kube).reconcile_namespace("ns")
    (second,) = audited()
    assert second["models"]["chat"]["targets"] == {"v1": 1, "v2": 1}
    assert any(c.startswith("updated") for c in second["changes"])


def test_a_gateway_fronts_a_tls_pool_and_a_plaintext_pool() -> None:
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", {
        **pool_spec("m-v1"), "workerTls": {"secretName": "v1-tls"}}))  # fmt: skip
    kube.add("inferencepools", obj("InferencePool", "v2", pool_spec("m-v2")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    kube.add("inferencemodels", obj("InferenceModel", "chat", model("front", "v1", "v2")))
    reconciler(kube).reconcile_namespace("ns")
    gateway = kube.status("inferencegateways", "front")
    assert gateway["phase"] == "Ready" and conditions(gateway)["Degraded"][0] == "False"
    config = yaml.safe_load(kube.children[("ConfigMap", "front-gateway")]["data"]["router.yaml"])
    v1, v2 = config["pools"]
    assert v1["worker_tls"]["ca_file"] == "/etc/kvflow-worker-tls/v1/ca.crt"
    assert "worker_tls" not in v2
    volumes = kube.children[("Deployment", "front-gateway")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls-v1", "secret": {"secretName": "v1-tls"}} in volumes


def test_a_response_cache_step_follows_the_gateways_response_cache() -> None:
    """A model's response_cache step reaches the router only while its gateway turns the
    router's response cache on; otherwise it is left out, and the gateway says why."""
    kube = FakeKube()
    kube.add("inferencepools", obj("InferencePool", "v1", pool_spec("m-v1")))
    kube.add("inferencegateways", obj("InferenceGateway", "front", GATEWAY))
    ladder = {"steps": ["drop_extras", "response_cache"],
              "slo": {"ttftTargetMs": 500, "tpotTargetMs": 50}}  # fmt: skip
    kube.add("inferencemodels", obj("InferenceModel", "chat",
                                    {**model("front", "v1"), "degradation": ladder}))  # fmt: skip

    def rendered() -> tuple[list[str], list[str]]:
        reconciler(kube).reconcile_namespace("ns")
        children = kube.children
        config = yaml.safe_load(children[("ConfigMap", "front-gateway")]["data"]["router.yaml"])
        deployment = children[("Deployment", "front-gateway")]
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return config["degradation"]["chat"]["steps"], args

    steps, args = rendered()
    assert steps == ["drop_extras"] and "--response-cache" not in args
    gateway = kube.status("inferencegateways", "front")
    assert conditions(gateway)["Degraded"] == ("True", "ResponseCacheOff")

    cached = {"router": {**GATEWAY["router"], "responseCache": {"enabled": True}}}
    kube.add("inferencegateways", obj("InferenceGateway", "front", cached))
    steps, args = rendered()
    assert steps == ["drop_extras", "response_cache"]
    assert args[args.index("--response-cache") + 1] == "on"
    assert kube.status("inferencegateways", "front")["phase"] == "Ready"
