"""An InferenceGateway's router config and children, from models and pools (pure)."""

from __future__ import annotations

from typing import Any

import yaml

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.gateway import (
    GatewayRef,
    desired_gateway_children,
    gateway_config,
    worker_token,
)
from kvflow.operator.builders.gateway_models import ModelObject, resolve
from kvflow.operator.builders.names import Images
from kvflow.operator.builders.router import CONFIG_HASH_ANNOTATION, CONFIG_KEY

GATEWAY = GatewayRef(name="front", namespace="ns", uid="uid-g", generation=2)
IMAGES = Images(worker="img/worker:1", router="img/router:1")


def pool(served: str, **overrides: Any) -> v1alpha1.InferencePoolSpec:
    data: dict[str, Any] = {"model": {"servedName": served}}
    data.update(overrides)
    return from_json(v1alpha1.InferencePoolSpec, data)


def model(name: str, *targets: tuple[str, int], **spec: Any) -> ModelObject:
    data: dict[str, Any] = {
        "gatewayRef": {"name": "front"},
        "targets": [{"poolRef": {"name": p}, "weight": w} for p, w in targets],
        **spec,
    }
    return ModelObject(name, from_json(gw.InferenceModelSpec, data))


def gateway_spec(**router: Any) -> gw.InferenceGatewaySpec:
    return from_json(gw.InferenceGatewaySpec, {"router": router})


POOLS = {
    "smol-v1": pool(
        "smollm2-v1",
        model={
            "servedName": "smollm2-v1",
            "path": "v1/model.gguf",
            "volume": {"persistentVolumeClaim": {"claimName": "weights"}},
        },
    ),
    "smol-v2": pool(
        "smollm2-v2",
        mode="disaggregated",
        prefill={},
        decode={},
        router={"disaggregation": {"minRemotePrefillTokens": 256}},
    ),
}


def test_config_has_a_pool_per_target_and_a_model_per_inference_model() -> None:
    resolution = resolve(
        [model("smollm2", ("smol-v1", 90), ("smol-v2", 10), aliases=["chat"])], POOLS
    )
    config = gateway_config("ns", gateway_spec(), resolution, POOLS)
    assert config["pools"] == [
        {
            "name": "smol-v1",
            "served_model_name": "smollm2-v1",
            "worker_dns": "smol-v1-workers.ns.svc:50051",
            # The pool's volume, mounted in the gateway pod at a folder of its own.
            "model": "/models/smol-v1/v1/model.gguf",
        },
        {
            "name": "smol-v2",
            "served_model_name": "smollm2-v2",
            "worker_dns": "smol-v2-workers.ns.svc:50051",
            "disaggregation": {"enabled": True, "min_remote_prefill_tokens": 256},
        },
    ]
    assert config["models"] == [
        {
            "name": "smollm2",
            "aliases": ["chat"],
            "targets": [{"pool": "smol-v1", "weight": 90}, {"pool": "smol-v2", "weight": 10}],
        }
    ]
    assert set(config) == {"routing", "pools", "models"}


def test_a_missing_pool_is_left_out_and_reported_and_an_unservable_model_dropped() -> None:
    resolution = resolve(
        [
            model("smollm2", ("smol-v1", 90), ("gone", 10)),
            model("ghost", ("gone", 5), ("smol-v2", 0)),
        ],
        POOLS,
    )
    assert [m.name for m in resolution.models] == ["smollm2"]
    assert [(t.pool, t.weight) for t in resolution.models[0].targets] == [("smol-v1", 90)]
    assert resolution.pools == ("smol-v1",)  # not smol-v2: only a weight-0 target names it
    accepted, dropped = resolution.verdicts["smollm2"], resolution.verdicts["ghost"]
    assert accepted.accepted and accepted.missing_pools == ("gone",)
    assert not dropped.accepted and dropped.reason == "NoTargetPool"
    assert [p.reason for p in resolution.problems] == ["TargetPoolMissing", "TargetPoolMissing"]
    assert "InferenceModel smollm2: target pool gone does not exist" in [
        p.message for p in resolution.problems
    ]


def test_the_older_model_keeps_a_contested_name_and_alias() -> None:
    resolution = resolve(
        [
            model("first", ("smol-v1", 1), aliases=["chat"]),
            model("second", ("smol-v2", 1), modelName="chat"),
            model("third", ("smol-v2", 1), aliases=["first"]),
        ],
        POOLS,
    )
    assert [m.name for m in resolution.models] == ["first"]
    for name in ("second", "third"):
        verdict = resolution.verdicts[name]
        assert (verdict.accepted, verdict.reason) == (False, "NameConflict")
    assert "already served for InferenceModel first" in resolution.verdicts["second"].message


def test_two_pools_with_one_served_name_cannot_share_a_gateway() -> None:
    pools = {"a": pool("same"), "b": pool("same")}
    resolution = resolve([model("m", ("a", 1), ("b", 1))], pools)
    assert [(t.pool, t.weight) for t in resolution.models[0].targets] == [("a", 1)]
    assert resolution.problems[0].reason == "ServedNameConflict"


def test_children_are_owned_by_the_gateway_and_named_apart_from_pools() -> None:
    resolution = resolve([model("smollm2", ("smol-v1", 90), ("smol-v2", 10))], POOLS)
    spec = gateway_spec(replicas=2)
    children = desired_gateway_children(GATEWAY, spec, IMAGES, resolution, POOLS)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", "front-gateway"),
        ("Service", "front"),
        ("Deployment", "front-gateway"),
        ("PodDisruptionBudget", "front-gateway"),
        ("NetworkPolicy", "front-gateway"),
    ]
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "InferenceGateway",
            "uid-g",
            True,
        )
        assert child["metadata"]["labels"]["kvflow.io/gateway"] == "front"
        assert "kvflow.io/pool" not in child["metadata"]["labels"]  # a pool's handler ignores it
    configmap, service, deployment, _, policy = children
    # Its routers take requests only (8000), as a pool's do; scrapes from no pod by default.
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"kvflow.io/gateway": "front", "kvflow.io/role": "router"}
    }
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [8000]
    assert len(policy["spec"]["ingress"]) == 1  # no scrapers named: 9401 admits no pod
    assert deployment["spec"]["template"]["metadata"]["labels"]["kvflow.io/gateway"] == "front"
    assert service["spec"]["selector"] == {"kvflow.io/gateway": "front", "kvflow.io/role": "router"}
    assert deployment["spec"]["replicas"] == 2
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    # The pools' NetworkPolicies let exactly these pods in.
    assert template["metadata"]["labels"]["fronts.kvflow.io/smol-v1"] == "true"
    assert template["metadata"]["labels"]["fronts.kvflow.io/smol-v2"] == "true"
    container = template["spec"]["containers"][0]
    assert container["args"][:7] == [
        "router", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "9401",
    ]  # fmt: skip
    # No one-pool flags: the config's pools section says it all (the router refuses both).
    assert not {"--model", "--served-model-name", "--worker-dns"} & set(container["args"])
    assert "--config" in container["args"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["model-smol-v1"]["persistentVolumeClaim"]["claimName"] == "weights"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["model-smol-v1"] == "/models/smol-v1"
    assert "model-smol-v2" not in mounts  # its model is the image's built-in one
    parsed = yaml.safe_load(configmap["data"][CONFIG_KEY])
    assert [p["name"] for p in parsed["pools"]] == ["smol-v1", "smol-v2"]


def test_weight_change_rolls_the_routers() -> None:
    def config_hash(v1: int, v2: int) -> str:
        resolution = resolve([model("smollm2", ("smol-v1", v1), ("smol-v2", v2))], POOLS)
        children = desired_gateway_children(GATEWAY, gateway_spec(), IMAGES, resolution, POOLS)
        template = children[2]["spec"]["template"]
        digest: str = template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        return digest

    assert config_hash(90, 10) == config_hash(90, 10)
    assert config_hash(90, 10) != config_hash(50, 50)


def test_no_servable_model_runs_no_router() -> None:
    resolution = resolve([model("ghost", ("gone", 1))], POOLS)
    children = desired_gateway_children(GATEWAY, gateway_spec(), IMAGES, resolution, POOLS)
    config = yaml.safe_load(children[0]["data"][CONFIG_KEY])
    assert "pools" not in config and "models" not in config
    assert children[2]["spec"]["replicas"] == 0


def test_one_worker_token_reaches_the_gateway_and_two_are_a_problem() -> None:
    secret = {"name": "tok", "key": "t"}
    pools = {"a": pool("a", workerTokenSecret=secret), "b": pool("b", workerTokenSecret=secret)}
    ref, problems = worker_token(["a", "b"], pools)
    assert ref is not None and (ref.name, ref.key) == ("tok", "t") and problems == []
    pools["b"] = pool("b", workerTokenSecret={"name": "other", "key": "t"})
    _, problems = worker_token(["a", "b"], pools)
    assert len(problems) == 1 and "a (tok/t), b (other/t)" in problems[0]
    # A pool without one has its own generated token: another token again.
    pools["b"] = pool("b")
    _, problems = worker_token(["a", "b"], pools)
    assert len(problems) == 1 and "b (b-worker-token/token)" in problems[0]
    # One pool alone: its generated token is the gateway's.
    ref, problems = worker_token(["b"], pools)
    assert ref is not None and (ref.name, ref.key) == ("b-worker-token", "token") and not problems
    resolution = resolve([model("m", ("a", 1))], pools)
    children = desired_gateway_children(GATEWAY, gateway_spec(), IMAGES, resolution, pools)
    env = children[2]["spec"]["template"]["spec"]["containers"][0]["env"]
    token = next(e for e in env if e["name"] == "KVFLOW_WORKER_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == secret


def test_each_tls_pool_has_its_secret_mounted_apart_and_its_own_worker_tls() -> None:
    pools = {
        **POOLS,
        "tls-a": pool("a", workerTls={"secretName": "a-tls"}),
        "tls-b": pool("b", workerTls={"secretName": "b-tls"}),
    }
    resolution = resolve([model("m", ("smol-v1", 1), ("tls-a", 1), ("tls-b", 1))], pools)
    children = desired_gateway_children(GATEWAY, gateway_spec(), IMAGES, resolution, pools)
    config = yaml.safe_load(children[0]["data"][CONFIG_KEY])
    entries = {p["name"]: p for p in config["pools"]}
    assert "worker_tls" not in entries["smol-v1"]  # plaintext (the router has no TLS flags)
    for name in ("tls-a", "tls-b"):
        mount = f"/etc/kvflow-worker-tls/{name}"
        assert entries[name]["worker_tls"] == {
            "ca_file": f"{mount}/ca.crt",
            "cert_file": f"{mount}/tls.crt",
            "key_file": f"{mount}/tls.key",
            # Dialled by pod IP; the pool's certificate names its headless Service.
            "server_name": f"{name}-workers.ns.svc",
        }
    template = children[2]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert not any(a.startswith("--worker-tls") for a in container["args"])  # per pool instead
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, secret in (("tls-a", "a-tls"), ("tls-b", "b-tls")):
        assert volumes[f"tls-{name}"]["secret"] == {"secretName": secret}
        assert mounts[f"tls-{name}"] == {
            "name": f"tls-{name}",
            "mountPath": f"/etc/kvflow-worker-tls/{name}",
            "readOnly": True,
        }
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(paths) == len(set(paths))  # no two volumes at one folder
    assert "tls-smol-v1" not in volumes
