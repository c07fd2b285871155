"""Desired-state builders: the router's command line, config and pod for a spec (pure; no
cluster)."""

from __future__ import annotations

from testkit.pool_spec import POOL, build, pod_of, spec_of

from kvflow.operator.api import v1alpha1
from kvflow.operator.builders.desired import ChildKey
from kvflow.operator.builders.router import CONFIG_HASH_ANNOTATION, router_args


def test_router_finds_workers_by_dns_and_reads_redis_from_a_secret() -> None:
    spec = spec_of(router={"redis": {"urlSecret": {"name": "redis", "key": "url"}}})
    assert router_args(POOL, spec) == [
        "router", "--host", "0.0.0.0", "--port", "8000", "--metrics-port", "9401",
        "--served-model-name", "m",
        "--worker-dns", "p-workers.ns.svc:50051",
        "--quota-scope", "ns/p",
        "--config", "/etc/kvflow/router.yaml",
        "--redis-url", "$(KVFLOW_REDIS_URL)",
        # A router with Redis serves the Batch API, paced by the pool's TPOT target.
        "--batch-online-tpot-target-s", "0.1",
    ]  # fmt: skip
    pod = pod_of(build(spec), "p-router")
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["KVFLOW_REDIS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "redis", "key": "url"}}


def test_router_flags_for_secure_defaults() -> None:
    # No tenants: the router listens off loopback only when the pool opted in.
    assert "--allow-unauthenticated" not in router_args(POOL, spec_of())
    opted = spec_of(router={"allowUnauthenticated": True})
    assert "--allow-unauthenticated" in router_args(POOL, opted)
    tenants = {"tenantsSecret": {"name": "t", "key": "tenants.yaml"}, "allowUnauthenticated": True}
    assert "--allow-unauthenticated" not in router_args(POOL, spec_of(router=tenants))
    # Every router replica derives cache salts from the same secret: the pool's worker token.
    pod = pod_of(build(spec_of()), "p-router")
    env = {e["name"]: e["valueFrom"] for e in pod["containers"][0]["env"] if "valueFrom" in e}
    assert env["KVFLOW_CACHE_SALT_SECRET"] == env["KVFLOW_WORKER_TOKEN"]
    assert env["KVFLOW_WORKER_TOKEN"] == {
        "secretKeyRef": {"name": "p-worker-token", "key": "token"}
    }


def test_router_reads_tenants_from_the_users_secret_without_rolling_on_a_change() -> None:
    tenants = {"name": "pool-tenants", "key": "tenants.yaml"}
    spec = spec_of(router={"tenantsSecret": tenants,
                           "tenantKeySecret": {"name": "pool-tenants", "key": "hmac"}})  # fmt: skip
    args = router_args(POOL, spec)
    assert args[args.index("--tenants-file") + 1] == "/etc/kvflow-tenants/tenants.yaml"
    deployment = build(spec)[ChildKey("apps/v1", "Deployment", "p-router")]
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    # A whole-volume mount (never subPath), so the kubelet's updates reach the file.
    assert volumes["tenants"]["secret"] == {
        "secretName": "pool-tenants",
        "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}],
    }
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tenants"]
    assert mount == {"name": "tenants", "mountPath": "/etc/kvflow-tenants", "readOnly": True}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["KVFLOW_TENANT_KEY_SECRET"]["valueFrom"] == {
        "secretKeyRef": {"name": "pool-tenants", "key": "hmac"}
    }
    # The Secret's contents are not in the pod template: changing them rolls nothing.
    plain = build(spec_of())[ChildKey("apps/v1", "Deployment", "p-router")]
    assert (
        deployment["spec"]["template"]["metadata"]["annotations"]
        == plain["spec"]["template"]["metadata"]["annotations"]
    )
    assert "--tenants-file" not in router_args(POOL, spec_of())


def test_router_admission_spec_becomes_the_routers_flags() -> None:
    base = router_args(POOL, spec_of())
    assert not [a for a in base if a.startswith("--admission")]  # the router's defaults
    spec = spec_of(router={"admission": {"shedQueueTimeSeconds": 2.5, "maxQueueTimeSeconds": 5,
                                         "pollIntervalSeconds": 0.25}})  # fmt: skip
    assert router_args(POOL, spec)[len(base):] == [
        "--admission-shed-queue-time-s", "2.5", "--admission-max-queue-time-s", "5.0",
        "--admission-poll-interval-s", "0.25",
    ]  # fmt: skip
    off = spec_of(router={"admission": {"enabled": False}})
    assert router_args(POOL, off)[len(base) :] == ["--admission", "off"]


def test_routing_config_change_rolls_the_routers() -> None:
    def config_hash(spec: v1alpha1.InferencePoolSpec) -> str:
        deployment = build(spec)[ChildKey("apps/v1", "Deployment", "p-router")]
        digest: str = deployment["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION
        ]
        return digest

    base = config_hash(spec_of())
    assert config_hash(spec_of()) == base  # deterministic
    assert config_hash(spec_of(router={"scorerWeights": {"prefixCache": 2.0}})) != base
