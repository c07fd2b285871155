"""InferenceGateway and InferenceModel in a real API server, with a real operator.

Two pools, one gateway, one model split 90/10 (samples/cpu-gateway-canary.yaml): the
operator renders the gateway's router
config from them, and a weight change rolls the gateway's routers (KWOK marks their pods
ready, so the status goes Ready as on a cluster).
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from k8s.controlplane import REPO, ControlPlane
from k8s.gateways import (
    HASH,
    apply,
    condition,
    get,
    manifest,
    model_spec,
    resolved,
    wait_gateway,
)
from k8s.operator_process import OperatorProcess
from k8s.pools import CONVERGE_S
from k8s.support import wait_for

SAMPLE = REPO / "samples" / "cpu-gateway-canary.yaml"


def router_config(cluster: ControlPlane, namespace: str) -> dict[str, Any]:
    configmap = get(cluster, "configmap", namespace, "front-gateway")
    config: dict[str, Any] = yaml.safe_load(configmap["data"]["router.yaml"])
    return config


def test_gateway_serves_two_pools_and_a_weight_change_rolls_it(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    # The sample: pools smol-v1 and smol-v2, gateway front, model smollm2 (alias chat) 90/10.
    cluster.kubectl("apply", "-n", namespace, "-f", str(SAMPLE))

    gateway = wait_gateway(cluster, namespace, "front", "Ready", resolved(90, 10))
    status = gateway["status"]
    assert status["endpoint"] == f"http://front.{namespace}.svc/v1"
    assert (status["readyReplicas"], status["desiredReplicas"]) == (1, 1)
    assert condition(gateway, "Degraded")["status"] == "False"
    config = router_config(cluster, namespace)
    assert config["pools"] == [
        {
            "name": name,
            "served_model_name": served,
            "worker_dns": f"{name}-workers.{namespace}.svc:50051",
        }
        for name, served in (("smol-v1", "smollm2-v1"), ("smol-v2", "smollm2-v2"))
    ]
    assert config["models"] == [
        {
            "name": "smollm2",
            "aliases": ["chat"],
            "targets": [{"pool": "smol-v1", "weight": 90}, {"pool": "smol-v2", "weight": 10}],
        }
    ]
    uid = gateway["metadata"]["uid"]
    children = ("deployment", "configmap", "poddisruptionbudget")
    for kind, name in [("service", "front"), *((k, "front-gateway") for k in children)]:
        (owner,) = get(cluster, kind, namespace, name)["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"]) == ("InferenceGateway", uid)
    deployment = get(cluster, "deployment", namespace, "front-gateway")
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["fronts.kvflow.io/smol-v2"] == "true"
    first_hash = template["metadata"]["annotations"][HASH]
    model = get(cluster, "inferencemodel", namespace, "smollm2")
    assert condition(model, "Accepted")["status"] == "True"
    assert condition(model, "ResolvedRefs")["status"] == "True"

    # A canary step: 50/50. The config changes, and with it the routers' template.
    cluster.kubectl(
        "patch", "inferencemodel", "smollm2", "-n", namespace, "--type", "merge",
        "-p", json.dumps({"spec": {"targets": [
            {"poolRef": {"name": "smol-v1"}, "weight": 50},
            {"poolRef": {"name": "smol-v2"}, "weight": 50},
        ]}}),
    )  # fmt: skip
    wait_gateway(cluster, namespace, "front", "Ready", resolved(50, 50))
    weights = [t["weight"] for t in router_config(cluster, namespace)["models"][0]["targets"]]
    assert weights == [50, 50]
    deployment = get(cluster, "deployment", namespace, "front-gateway")
    assert deployment["spec"]["template"]["metadata"]["annotations"][HASH] != first_hash

    # Drift: the router Deployment deleted by hand is put back at once (it is watched).
    uid_before = deployment["metadata"]["uid"]
    cluster.kubectl("delete", "deployment", "front-gateway", "-n", namespace, "--wait=false")

    def recreated() -> bool:
        found = cluster.kubectl(
            "get", "deployment", "front-gateway", "-n", namespace, "-o", "json", check=False
        )
        return found.returncode == 0 and json.loads(found.stdout)["metadata"]["uid"] != uid_before

    wait_for(recreated, CONVERGE_S, "the gateway's Deployment to be recreated")

    # A model naming a pool and a gateway that do not exist: both say so.
    apply(cluster, "InferenceModel", namespace, "lost", model_spec("nowhere", gone=1))
    apply(cluster, "InferenceModel", namespace, "canary", {
        **model_spec("front", gone=1), "aliases": []})  # fmt: skip
    gateway = wait_gateway(cluster, namespace, "front", "Degraded", resolved(50, 50))
    assert (
        "InferenceModel canary: target pool gone does not exist"
        in (condition(gateway, "Degraded")["message"])
    )

    def model_reason(name: str) -> str | None:
        reason: str | None = condition(
            get(cluster, "inferencemodel", namespace, name), "Accepted"
        ).get("reason")
        return reason

    wait_for(lambda: model_reason("lost") == "GatewayNotFound", CONVERGE_S, "GatewayNotFound")
    assert model_reason("canary") == "NoTargetPool"


def dry_run(cluster: ControlPlane, namespace: str, kind: str, name: str, spec: Any) -> Any:
    return cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-",
        input=manifest(kind, namespace, name, spec), check=False,
    )  # fmt: skip


GOOD_MODEL = model_spec("front", a=1)
TARGETS = GOOD_MODEL["targets"]


def degraded(**degradation: Any) -> dict[str, Any]:
    return {**GOOD_MODEL, "degradation": degradation}


# (kind, name, spec, what the API server answers; "" for accepted)
CASES: list[tuple[str, str, Any, str]] = [
    ("InferenceModel", "ok", GOOD_MODEL, ""),
    ("InferenceModel", "negative", model_spec("front", a=-1), "greater than or equal to 0"),
    ("InferenceModel", "none", {**GOOD_MODEL, "targets": []}, "should have at least 1 items"),
    ("InferenceModel", "zeros", model_spec("front", a=0, b=0), "needs a weight above 0"),
    ("InferenceModel", "twice", {**GOOD_MODEL, "targets": TARGETS * 2}, "a target once"),
    ("InferenceModel", "alias", {**GOOD_MODEL, "modelName": "chat"}, "alias must differ"),
    ("InferenceModel", "lone", {"targets": TARGETS}, "spec.gatewayRef: Required value"),
    ("InferenceGateway", "ok", {}, ""),
    ("InferenceGateway", "smol-gateway", {}, "must not end in -gateway or -workers"),
    ("InferenceGateway", "front", {"router": {"replicas": 0}}, "spec.router.replicas"),
]
# Automatic degradation: each step's field, hysteresis, a deadline within the router's bound.
CASES += [
    ("InferenceModel", "degraded", degraded(steps=["cap_max_tokens", "queue_with_deadline"],
                                            maxTokensCap=64, queueDeadlineSeconds=5), ""),
    ("InferenceModel", "no-cap", degraded(steps=["cap_max_tokens"]),
     "step cap_max_tokens needs maxTokensCap"),
    ("InferenceModel", "no-fallback", degraded(steps=["fallback_model"]),
     "step fallback_model needs fallbackModel"),
    ("InferenceModel", "flapping", degraded(steps=["drop_extras"], releaseBurn=3),
     "releaseBurn must be at most engageBurn"),
    # response_cache needs the gateway's router.responseCache (left out otherwise).
    ("InferenceModel", "cache", degraded(steps=["drop_extras", "response_cache"]), ""),
    ("InferenceGateway", "cached", {"router": {"responseCache": {"enabled": True,
                                                                 "ttlSeconds": 60}}}, ""),
    ("InferenceGateway", "forgetful", {"router": {"responseCache": {"ttlSeconds": 0}}},
     "spec.router.responseCache.ttlSeconds"),
    ("InferenceModel", "forever", degraded(steps=["queue_with_deadline"],
                                           queueDeadlineSeconds=3600), "less than or equal to 300"),
]  # fmt: skip


# The model cascade: two different models, and no empty refusal pattern.
CASES += [
    ("InferenceModel", "cascaded", {**GOOD_MODEL, "cascade": {
        "small": "small", "large": "large",
        "checks": {"minMeanLogprob": -1.5, "refusalPatterns": ["(?i)sorry"]}}}, ""),
    ("InferenceModel", "same", {**GOOD_MODEL, "cascade": {"small": "a", "large": "a"}},
     "small and large must be two models"),
    ("InferenceModel", "no-large", {**GOOD_MODEL, "cascade": {"small": "a"}},
     "spec.cascade.large: Required value"),
    ("InferenceModel", "sure", {**GOOD_MODEL, "cascade": {
        "small": "a", "large": "b", "checks": {"minMeanLogprob": 0.5}}},
     "less than or equal to 0"),
    ("InferenceModel", "empty", {**GOOD_MODEL, "cascade": {
        "small": "a", "large": "b", "checks": {"refusalPatterns": [""]}}},
     "a refusal pattern must not be empty"),
]  # fmt: skip


def test_crd_validation_rejects_bad_objects_at_the_api_server(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    # One namespace for all cases: a dry run stores nothing, and namespaces cost seconds.
    for kind, name, spec, message in CASES:
        out = dry_run(cluster, namespace, kind, name, spec)
        if not message:
            assert out.returncode == 0, (name, out.stderr)
        else:
            assert out.returncode != 0, name
            assert message in out.stderr, (name, out.stderr)


def test_the_charts_example_gateway_fronts_the_example_pool(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    """What `helm install --set examplePool.enabled=true --set exampleGateway.enabled=true`
    creates (the chart's templates, rendered by the real helm) reconciles to Ready."""
    out = cluster.helm(
        "template", "kvflow", str(REPO / "helm" / "kvflow"), "--namespace", namespace,
        "--set", "examplePool.enabled=true", "--set", "exampleGateway.enabled=true",
    )  # fmt: skip
    kinds = ("InferencePool", "InferenceGateway", "InferenceModel")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in kinds]
    assert sorted(d["kind"] for d in docs) == sorted(kinds)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    served = [{"name": "smollm2", "aliases": [], "source": "smollm2",
               "targets": [{"pool": "smollm2", "weight": 1}]}]  # fmt: skip
    gateway = wait_gateway(cluster, namespace, "front", "Ready", served)
    assert gateway["status"]["endpoint"] == f"http://front.{namespace}.svc/v1"
