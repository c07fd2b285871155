"""The gateway of a pool: its routing ConfigMap and router Deployment (pure)."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import yaml

from kvflow.operator.api import (
    v1alpha1,
    v1alpha1_admission,
    v1alpha1_model,
    v1alpha1_response_cache,
    v1alpha1_router,
)
from kvflow.operator.api.schema import Json
from kvflow.operator.builders import pods, router_features
from kvflow.operator.builders.names import (
    ROUTER_HTTP_PORT,
    ROUTER_METRICS_PORT,
    WORKER_GRPC_PORT,
    Images,
    PoolRef,
    metadata,
    router_name,
    selector_labels,
    workers_service_name,
    workers_tls_name,
)
from kvflow.operator.builders.worker_token import effective_worker_token

CONFIG_MOUNT = "/etc/kvflow"
CONFIG_KEY = "router.yaml"
CONFIG_HASH_ANNOTATION = "kvflow.io/router-config-sha256"
REDIS_URL_ENV = "KVFLOW_REDIS_URL"
# The tenants Secret: a volume of its own (not subPath, so the kubelet's updates reach the
# running router, which re-reads the file), beside the ConfigMap, not inside its mount.
TENANTS_MOUNT = "/etc/kvflow-tenants"
TENANTS_FILE = "tenants.yaml"
TENANT_KEY_SECRET_ENV = "KVFLOW_TENANT_KEY_SECRET"


def router_config(spec: v1alpha1.InferencePoolSpec) -> dict[str, Json]:
    """The YAML `kvflow router --config` reads (its format: `kvflow.router.settings`).

    Only routing settings that are not flags; the router rejects unknown keys, and
    tests/contracts holds this builder to the router's parser. The disaggregation section
    is written for disaggregated pools only, so a colocated pool's routers never change.
    """
    config: dict[str, Json] = {"routing": routing_section(spec.router)}
    if spec.mode == "disaggregated":
        config["disaggregation"] = disaggregation_config(spec.router.disaggregation)
    prices = prices_entry(spec.model.prices)
    if prices is not None:
        config["prices"] = {spec.model.served_name: prices}
    limits = router_features.rate_limits_section(spec.router.rate_limits)
    if limits is not None:
        config["rate_limits"] = limits
    return config


def prices_entry(prices: v1alpha1_model.PriceSpec | None) -> dict[str, Json] | None:
    """One model's entry of the router's `prices:` section: decimal strings, as the router
    parses them exactly."""
    if prices is None:
        return None
    entry: dict[str, Json] = {
        "input_usd_per_million_tokens": prices.input_usd_per_million_tokens,
        "output_usd_per_million_tokens": prices.output_usd_per_million_tokens,
    }
    if prices.cached_input_usd_per_million_tokens is not None:
        entry["cached_input_usd_per_million_tokens"] = prices.cached_input_usd_per_million_tokens
    return entry


def routing_section(router: v1alpha1_router.RouterSpec) -> dict[str, Json]:
    """The router config's `routing:` section: the scorer weights (a pool's or a gateway's)."""
    weights = router.scorer_weights
    # Each field's snake_case name is the router's name for its scorer (the contract
    # tests/contracts/test_scorers.py checks), so the weights pass through untranslated.
    named = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    if all(value is None for value in named.values()):
        return {}  # the router's default: the time-based scorer
    # The router picks the policy from the names set (kvflow.router.settings): a block
    # weight without time_cost, the block policy; else the time-based default. Either way
    # its unset weights stay at the router's values.
    return {"weights": {name: value for name, value in named.items() if value is not None}}


def disaggregation_config(policy: v1alpha1_router.DisaggregationSpec) -> dict[str, Json]:
    """The router's `disaggregation:` section; unset fields keep the router's defaults."""
    section: dict[str, Json] = {"enabled": True}
    optional = {
        "min_remote_prefill_tokens": policy.min_remote_prefill_tokens,
        "max_prefill_queue_depth": policy.max_prefill_queue_depth,
        "transfer_timeout_s": policy.transfer_timeout_seconds,
    }
    section.update({key: value for key, value in optional.items() if value is not None})
    return section


def router_configmap(pool: PoolRef, spec: v1alpha1.InferencePoolSpec) -> dict[str, Json]:
    text = yaml.safe_dump(router_config(spec), sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pool, router_name(pool), "router", "router"),
        "data": {CONFIG_KEY: text},
    }


def worker_dns(pool: PoolRef) -> str:
    """The headless Service's name, whose A records list the ready workers."""
    return f"{workers_service_name(pool)}.{pool.namespace}.svc:{WORKER_GRPC_PORT}"


def router_args(pool: PoolRef, spec: v1alpha1.InferencePoolSpec) -> list[str]:
    """The `kvflow router` command line (the router's CLI contract)."""
    args = listen_args()
    path = pods.model_path(spec.model)
    if path:
        args += ["--model", path]
    args += [
        "--served-model-name", spec.model.served_name,
        "--worker-dns", worker_dns(pool),
        # Quota keys per pool: two pools sharing a Redis never share a tenant's counters.
        "--quota-scope", f"{pool.namespace}/{pool.name}",
    ]  # fmt: skip
    if spec.worker_tls is not None:
        # Workers are dialled by pod IP; their certificate names the headless Service.
        args += pods.worker_tls_client_args(workers_tls_name(pool))
    return args + shared_args(spec.router, slo_tpot_target_ms=spec.slo.tpot_target_ms)


def listen_args() -> list[str]:
    return ["router", "--host", "0.0.0.0", "--port", str(ROUTER_HTTP_PORT),
            "--metrics-port", str(ROUTER_METRICS_PORT)]  # fmt: skip


def shared_args(
    router: v1alpha1_router.RouterSpec, *, slo_tpot_target_ms: int | None = None
) -> list[str]:
    """Flags every router gets from its RouterSpec, a pool's or a gateway's (a pool's
    router also paces batch requests by its pool's TPOT target)."""
    args = ["--config", f"{CONFIG_MOUNT}/{CONFIG_KEY}"]
    redis = router.redis
    if redis.url_secret is not None:
        # Kubernetes expands $(VAR) in args, so the password never appears in the spec.
        args += ["--redis-url", f"$({REDIS_URL_ENV})"]
    elif redis.url:
        args += ["--redis-url", redis.url]
    if router.tenants_secret is not None:
        args += ["--tenants-file", f"{TENANTS_MOUNT}/{TENANTS_FILE}"]
    elif router.allow_unauthenticated:
        # The router refuses to listen off loopback with no tenants unless told to.
        args.append("--allow-unauthenticated")
    return [
        *args,
        *admission_args(router.admission),
        *response_cache_args(router.response_cache),
        *router_features.rate_limit_args(router.rate_limits),
        *router_features.breaker_args(router.circuit_breaker),
        *router_features.batch_args(
            router.batch,
            has_redis=redis.url_secret is not None or bool(redis.url),
            slo_tpot_target_ms=slo_tpot_target_ms,
        ),
    ]


def admission_args(admission: v1alpha1_admission.AdmissionSpec) -> list[str]:
    """The router's --admission* flags; none for unset fields (the router's defaults)."""
    args = [] if admission.enabled else ["--admission", "off"]
    for flag, value in (
        ("--admission-shed-queue-time-s", admission.shed_queue_time_seconds),
        ("--admission-max-queue-time-s", admission.max_queue_time_seconds),
        ("--admission-poll-interval-s", admission.poll_interval_seconds),
    ):
        if value is not None:
            args += [flag, str(value)]
    return args


def response_cache_args(cache: v1alpha1_response_cache.ResponseCacheSpec) -> list[str]:
    """The router's --response-cache* flags; none while it is off (the router's default)."""
    if not cache.enabled:
        return []
    args = ["--response-cache", "on"]
    for flag, value in (
        ("--response-cache-ttl-s", cache.ttl_seconds),
        ("--response-cache-max-mib", cache.max_mib),
        ("--response-cache-max-entry-kib", cache.max_entry_kib),
    ):
        if value is not None:
            args += [flag, str(value)]
    return args


def router_deployment(
    pool: PoolRef, spec: v1alpha1.InferencePoolSpec, images: Images
) -> dict[str, Json]:
    model_volume = pods.model_volume(spec.model)  # the router tokenizes with the model's files
    tls_volume = pods.worker_tls_volume(spec.worker_tls)
    volumes = [v for v in (model_volume, tls_volume) if v is not None]
    return router_workload(
        RouterPod(
            meta=metadata(pool, router_name(pool), "router", "router"),
            select=selector_labels(pool, "router"),
            config_map=router_name(pool),
            config_text=router_configmap(pool, spec)["data"][CONFIG_KEY],
            args=router_args(pool, spec),
            env=[
                *pods.router_secret_env(effective_worker_token(pool.name, spec)),
                *pods.tracing_env(pool.name, spec),
            ],
            volumes=volumes,
        ),
        spec.router,
        images,
    )


@dataclass(frozen=True)
class RouterPod:
    """What differs between a pool's router and a standalone gateway's."""

    meta: dict[str, Json]  # the Deployment's metadata (name, labels, owner)
    select: dict[str, str]  # its selector labels
    config_map: str  # the ConfigMap holding CONFIG_KEY
    config_text: str  # its content (hashed into the template: a change rolls the routers)
    args: list[str]
    env: list[dict[str, Json]]  # after common_env(), before the RouterSpec's secrets
    volumes: list[tuple[dict[str, Json], dict[str, Json]]]  # (volume, mount): model, TLS
    pod_labels: dict[str, str] = dataclass_field(default_factory=dict)  # beyond meta's


def router_workload(
    pod: RouterPod, router: v1alpha1_router.RouterSpec, images: Images
) -> dict[str, Json]:
    """The router Deployment: hardened, probed, draining, rolled by its config's hash."""
    scratch, scratch_mount = pods.scratch_volume()
    volumes: list[Json] = [scratch, {"name": "config", "configMap": {"name": pod.config_map}}]
    mounts: list[Json] = [
        scratch_mount,
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    tenants = router.tenants_secret
    if tenants is not None:
        items: Json = [{"key": tenants.key, "path": TENANTS_FILE}]
        volumes.append({"name": "tenants", "secret": {"secretName": tenants.name, "items": items}})
        mounts.append({"name": "tenants", "mountPath": TENANTS_MOUNT, "readOnly": True})
    batch = router_features.batch_volume(router.batch)
    for volume, mount in [*pod.volumes, *([batch] if batch is not None else [])]:
        volumes.append(volume)
        mounts.append(mount)

    env = [*pods.common_env(), *pod.env]
    for name, ref in ((REDIS_URL_ENV, router.redis.url_secret),
                      (TENANT_KEY_SECRET_ENV, router.tenant_key_secret)):  # fmt: skip
        if ref is not None:
            secret_ref: Json = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
            env.append({"name": name, "valueFrom": secret_ref})

    container: dict[str, Json] = {
        "name": "router",
        "image": router.image or images.router,
        "imagePullPolicy": router.image_pull_policy,
        "command": ["kvflow"],
        "args": pod.args,
        "ports": [
            {"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": pods.resources(router.resources),
        "livenessProbe": pods.http_probe("/health", "http", 10, 3),
        "readinessProbe": pods.http_probe("/ready", "http", 5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": pods.PRESTOP_SLEEP_S}}},
        "securityContext": pods.container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec = pods.pod_spec(
        container=container,
        volumes=volumes,
        select=pod.select,
        grace_s=30 + pods.PRESTOP_SLEEP_S,
        run_as_uid=images.run_as_uid,
        node_selector=router.node_selector,
        tolerations=router.tolerations,
    )

    digest = hashlib.sha256(pod.config_text.encode()).hexdigest()
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pod.meta,
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": dict(pod.select)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {
                # A changed routing config restarts the routers (they read it at start).
                "metadata": {
                    "labels": {**pod.meta["labels"], **pod.pod_labels},
                    "annotations": {CONFIG_HASH_ANNOTATION: digest},
                },
                "spec": pod_spec,
            },
        },
    }
