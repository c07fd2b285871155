"""The router's limits, circuit breaker, Batch API storage, embedding pools and a gateway's
semantic cache on the real API server: the CRDs refuse bad values with the schema's
message, and the operator renders a pool that sets them into Deployments whose args and
config carry them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from k8s.controlplane import ControlPlane
from k8s.gateways import SHARED_TOKEN, apply, condition, get, manifest, pool_spec
from k8s.operator_process import OperatorProcess
from k8s.pools import CONVERGE_S, apply_pool, wait_ready
from k8s.support import wait_for

POOL: dict[str, Any] = {"model": {"servedName": "m"}}


def dry_run(cluster: ControlPlane, namespace: str, kind: str, spec: dict[str, Any]) -> Any:
    return cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-",
        input=manifest(kind, namespace, "x", spec), check=False,
    )  # fmt: skip


def with_router(**router: Any) -> dict[str, Any]:
    return {**POOL, "router": {"allowUnauthenticated": True, **router}}


# (kind, spec, what the API server answers; "" for accepted)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("InferencePool", with_router(rateLimits={"global": {"requestsPerMinute": -5}}),
     "spec.router.rateLimits.global.requestsPerMinute: Invalid value: -5: "
     "spec.router.rateLimits.global.requestsPerMinute in body should be greater than or equal "
     "to 1"),
    ("InferencePool", with_router(rateLimits={"clientIp": {"maxInFlight": 0}}),
     "should be greater than or equal to 1"),
    ("InferencePool", with_router(rateLimits={"models": [{"name": "m", "tokensPerMinute": 0}]}),
     "should be greater than or equal to 1"),
    ("InferencePool", with_router(rateLimits={"trustedProxyCidrs": ["10.0.0.1/8"]}),
     "router.rateLimits.trustedProxyCidrs must be CIDRs without host bits"),
    ("InferencePool", with_router(rateLimits={"trustedProxyCidrs": ["proxy"]}),
     "router.rateLimits.trustedProxyCidrs must be CIDRs without host bits"),
    ("InferencePool", with_router(rateLimits={"trustedProxyCidrs": ["10.0.0.0/8", "fd00::/8"],
                                              "models": [{"name": "m", "maxInFlight": 4}]}), ""),
    ("InferencePool", with_router(circuitBreaker={"errorRateThreshold": 1.5}),
     "should be less than or equal to 1"),
    ("InferencePool", with_router(circuitBreaker={"openSeconds": 600}),
     "router.circuitBreaker.openSeconds must be at most maxOpenSeconds"),
    ("InferencePool", with_router(batch={"storage": "Volume"}),
     "router.batch.storage Volume needs router.batch.persistentVolumeClaim"),
    ("InferencePool", with_router(replicas=2, batch={
        "storage": "Volume", "persistentVolumeClaim": {"claimName": "b"}}),
     "router.batch.storage Volume holds one router's batches"),
    ("InferencePool", with_router(batch={"storage": "Redis"}),
     "router.batch.storage Redis needs router.redis"),
    ("InferencePool", with_router(batch={"priceFactor": "1.5"}), "spec.router.batch.priceFactor"),
    ("InferencePool", with_router(batch={"storage": "Volume",
                                         "persistentVolumeClaim": {"claimName": "b"}}), ""),
    ("InferencePool", {**POOL, "task": "embed", "model": {"servedName": "e", "path": "/m.gguf"}},
     "task embed serves the worker image's built-in wordllama-l2-supercat"),
    ("InferencePool", {**POOL, "task": "embed", "engine": {"simulate": True}},
     "task embed runs no engine to simulate"),
    ("InferencePool", {**POOL, "task": "embed", "mode": "disaggregated", "prefill": {},
                       "decode": {}}, "task embed runs no engine to split"),
    ("InferencePool", {**POOL, "task": "embed", "embedding": {"maxInputTokens": 0}},
     "should be greater than or equal to 1"),
    ("InferencePool", {**POOL, "task": "embed"}, ""),
    ("InferenceGateway", {"semanticCache": {"embeddingModel": "e", "similarityThreshold": 2}},
     "should be less than or equal to 1"),
    ("InferenceGateway", {"semanticCache": {"embeddingModel": "e", "maxMiB": -1}},
     "should be greater than 0"),
    ("InferenceGateway", {"semanticCache": {}}, "embeddingModel: Required value"),
    ("InferenceModel", {"gatewayRef": {"name": "g"}, "targets": [{"poolRef": {"name": "p"}}],
                        "semanticCache": {"similarityThreshold": 0}},
     "should be greater than 0"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "spec", "message"), CASES)
def test_the_crds_judge_the_new_fields(
    cluster: ControlPlane, crd: str, namespace: str, kind: str, spec: dict[str, Any], message: str
) -> None:
    out = dry_run(cluster, namespace, kind, spec)
    if not message:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode != 0
        assert message in out.stderr, out.stderr


def test_the_operator_renders_the_new_fields_into_the_deployments(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    spec = {
        "model": {"servedName": "wordllama"},
        "task": "embed",
        "embedding": {"maxInputsPerRequest": 64},
        "router": {
            "redis": {"url": "redis://redis:6379/0"},
            "rateLimits": {
                "global": {"maxInFlight": 512},
                "clientIp": {"requestsPerMinute": 120},
                "models": [{"name": "wordllama", "tokensPerMinute": 500000}],
                "trustedProxyCidrs": ["10.0.0.0/8"],
            },
            "circuitBreaker": {"minRequests": 20},
            "batch": {"storage": "Redis", "maxLines": 100},
        },
    }
    apply_pool(cluster, namespace, "emb", spec)
    wait_ready(cluster, namespace, "emb")

    def args(name: str) -> list[str]:
        got = cluster.kubectl_json("get", "deployment", name, "-n", namespace)
        result: list[str] = got["spec"]["template"]["spec"]["containers"][0]["args"]
        return result

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    worker = args("emb-colocated")
    assert flag(worker, "--task") == "embed"
    assert flag(worker, "--max-embedding-inputs") == "64"
    router = args("emb-router")
    assert flag(router, "--global-max-in-flight") == "512"
    assert flag(router, "--client-ip-requests-per-minute") == "120"
    assert flag(router, "--trusted-proxy-cidrs") == "10.0.0.0/8"
    assert flag(router, "--breaker-min-requests") == "20"
    assert flag(router, "--batch-max-lines") == "100"
    config = cluster.kubectl_json("get", "configmap", "emb-router", "-n", namespace)
    section = yaml.safe_load(config["data"]["router.yaml"])["rate_limits"]
    assert section == {"models": {"wordllama": {"tokens_per_minute": 500000}}}


def test_a_gateways_semantic_cache_is_rendered_or_reported(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str
) -> None:
    apply(cluster, "InferencePool", namespace, "chat", pool_spec("smol"))
    embed_pool = {"model": {"servedName": "wordllama"}, "task": "embed",
                  "workerTokenSecret": SHARED_TOKEN}  # fmt: skip
    apply(cluster, "InferencePool", namespace, "emb", embed_pool)
    apply(cluster, "InferenceModel", namespace, "chat", {
        "gatewayRef": {"name": "front"}, "targets": [{"poolRef": {"name": "chat"}}],
        "semanticCache": {"similarityThreshold": 0.98}})  # fmt: skip
    apply(cluster, "InferenceModel", namespace, "wordllama", {
        "gatewayRef": {"name": "front"}, "targets": [{"poolRef": {"name": "emb"}}]})  # fmt: skip
    gateway = {"semanticCache": {"embeddingModel": "wordllama", "ttlSeconds": 60}}
    apply(cluster, "InferenceGateway", namespace, "front", gateway)

    def section() -> dict[str, Any] | None:
        """The gateway's router.yaml; None before its ConfigMap exists."""
        found = cluster.kubectl("get", "configmap", "front-gateway", "-n", namespace,
                                "-o", "json", check=False)  # fmt: skip
        if found.returncode != 0:
            return None
        config: dict[str, Any] = yaml.safe_load(json.loads(found.stdout)["data"]["router.yaml"])
        return config

    wait_for(lambda: (section() or {}).get("semantic_cache"), CONVERGE_S, "semantic_cache")
    rendered = (section() or {})["semantic_cache"]
    assert rendered["embedding_model"] == "wordllama" and rendered["ttl_s"] == 60
    assert rendered["models"] == {"chat": {"threshold": 0.98}}

    # An embedding model that generates: the router would refuse it, so it is left out and
    # the gateway says why.
    apply(
        cluster,
        "InferenceGateway",
        namespace,
        "front",
        {"semanticCache": {"embeddingModel": "chat"}},
    )

    def degraded() -> str | None:
        message = condition(get(cluster, "inferencegateway", namespace, "front"), "Degraded")
        return (
            message.get("message") if message.get("reason") == "EmbeddingModelUnavailable" else None
        )

    assert "does not target pools with task embed" in wait_for(degraded, CONVERGE_S, "Degraded")
    wait_for(lambda: "semantic_cache" not in (section() or {"semantic_cache": 1}), CONVERGE_S,
             "semantic_cache left out")  # fmt: skip
