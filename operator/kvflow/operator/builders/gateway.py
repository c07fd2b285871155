"""An InferenceGateway's children: routing ConfigMap, router Deployment, Service, budget
(pure).

The router Deployment is a pool's router (`router.router_workload`) with a different
config: one `pools:` entry per InferencePool its models target, each pool's model volume
mounted at its own folder, and the `models:` its InferenceModels ask for (the format is
`kvflow.router.settings`'s). A pool with worker TLS (spec.workerTls) has its Secret mounted
at a folder of its own too, and its `pools:` entry says to dial its workers with it (the
router's `worker_tls`), so one gateway fronts TLS and plaintext pools together. The
gateway's pods carry a `fronts.kvflow.io/<pool>` label per pool they front; each pool's
NetworkPolicy lets exactly those pods reach its workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml

from kvflow.operator.api import v1alpha1, v1alpha1_model, v1alpha1_router
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_cascade import CascadeSpec
from kvflow.operator.api.v1alpha1_degradation import DegradationSpec
from kvflow.operator.builders import pods, router_features
from kvflow.operator.builders.gateway_models import Resolution
from kvflow.operator.builders.names import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_ROLE,
    MANAGED_BY,
    Images,
    PoolRef,
    fronts_label,
    workers_service_name,
)
from kvflow.operator.builders.network import (
    NO_SCRAPERS,
    MetricsScrapers,
    router_ingress_policy,
)
from kvflow.operator.builders.router import (
    CONFIG_KEY,
    RouterPod,
    disaggregation_config,
    listen_args,
    prices_entry,
    router_workload,
    routing_section,
    shared_args,
    worker_dns,
)
from kvflow.operator.builders.worker_token import effective_worker_token

LABEL_GATEWAY = "kvflow.io/gateway"
# Each pool's model volume, read-only, in a folder of its own: /models/<pool>.
GATEWAY_MODELS_MOUNT = pods.MODEL_MOUNT


@dataclass(frozen=True)
class GatewayRef:
    """The identity of the InferenceGateway that owns the objects being built."""

    name: str
    namespace: str
    uid: str
    generation: int = 0


def gateway_workload_name(gateway: GatewayRef) -> str:
    """Its Deployment, ConfigMap and budget; never a pool's (<pool>-<role>, -router)."""
    return f"{gateway.name}-gateway"


def gateway_service_name(gateway: GatewayRef) -> str:
    return gateway.name


def gateway_endpoint(gateway: GatewayRef, port: int) -> str:
    host = f"{gateway_service_name(gateway)}.{gateway.namespace}.svc"
    return f"http://{host}/v1" if port == 80 else f"http://{host}:{port}/v1"


def selector_labels(gateway: GatewayRef) -> dict[str, str]:
    """Never change them: a Deployment's selector is immutable."""
    return {LABEL_GATEWAY: gateway.name, LABEL_ROLE: "router"}


def gateway_labels(gateway: GatewayRef) -> dict[str, str]:
    """What the operator lists a gateway's children by."""
    return {LABEL_GATEWAY: gateway.name, LABEL_MANAGED_BY: MANAGED_BY}


def metadata(gateway: GatewayRef, name: str) -> dict[str, Json]:
    """With the gateway as controlling owner, so deleting it collects its children."""
    return {
        "name": name,
        "namespace": gateway.namespace,
        "labels": {
            "app.kubernetes.io/name": "kvflow-router",
            "app.kubernetes.io/instance": gateway.name,
            "app.kubernetes.io/part-of": "kvflow",
            LABEL_COMPONENT: "router",
            LABEL_MANAGED_BY: MANAGED_BY,
            **selector_labels(gateway),
        },
        "ownerReferences": [
            {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": gw.GATEWAY_KIND,
                "name": gateway.name,
                "uid": gateway.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def pool_model_mount(pool: str) -> str:
    return f"{GATEWAY_MODELS_MOUNT}/{pool}"


def pool_model_path(pool: str, model: v1alpha1_model.ModelSpec) -> str:
    """The pool's tokenizer and chat template as the gateway pod sees them; empty: the
    router's built-in model."""
    if model.volume is not None and model.path:
        return f"{pool_model_mount(pool)}/{model.path}"
    return model.path


def pool_tls_mount(pool: str) -> str:
    """Each pool's TLS Secret in a folder of its own: pools behind one gateway may hold
    different certificates, signed by different CAs."""
    return f"{pods.WORKER_TLS_MOUNT}/{pool}"


def pool_worker_tls(pool: str, namespace: str) -> dict[str, Json]:
    """The `worker_tls` of a TLS pool's `pools:` entry: as its own router dials it
    (builders/router.py), from the gateway's mount of its Secret."""
    mount = pool_tls_mount(pool)
    service = workers_service_name(PoolRef(name=pool, namespace=namespace, uid=""))
    return {
        "ca_file": f"{mount}/ca.crt",
        "cert_file": f"{mount}/tls.crt",
        "key_file": f"{mount}/tls.key",
        # Workers are dialled by pod IP; their certificate names the headless Service.
        "server_name": f"{service}.{namespace}.svc",
    }


def gateway_config(
    namespace: str,
    spec: gw.InferenceGatewaySpec,
    resolution: Resolution,
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
) -> dict[str, Json]:
    """The YAML `kvflow router --config` reads: routing weights, `pools:` and `models:`.
    No pools (no servable model): no sections, and no router runs (replicas 0)."""
    config: dict[str, Json] = {"routing": routing_section(spec.router)}
    if not resolution.pools:
        return config
    entries: list[Json] = []
    for name in resolution.pools:
        pool = pools[name]
        entry: dict[str, Json] = {
            "name": name,
            "served_model_name": pool.model.served_name,
            "worker_dns": worker_dns(PoolRef(name=name, namespace=namespace, uid="")),
        }
        path = pool_model_path(name, pool.model)
        if path:
            entry["model"] = path
        if pool.mode == "disaggregated":
            entry["disaggregation"] = disaggregation_config(pool.router.disaggregation)
        if pool.worker_tls is not None:
            entry["worker_tls"] = pool_worker_tls(name, namespace)
        entries.append(entry)
    config["pools"] = entries
    # Each pool's prices under its served name, the name the router charges spend by; pools
    # serving one name share an entry (the first pool's, in the resolution's order).
    prices: dict[str, Json] = {}
    for name in resolution.pools:
        price = prices_entry(pools[name].model.prices)
        if price is not None:
            prices.setdefault(pools[name].model.served_name, price)
    if prices:
        config["prices"] = prices
    config["models"] = [
        {
            "name": m.name,
            **({"aliases": list(m.aliases)} if m.aliases else {}),
            "targets": [{"pool": t.pool, "weight": t.weight} for t in m.targets],
        }
        for m in resolution.models
    ]
    if resolution.degradations:
        config["degradation"] = {
            name: degradation_entry(d) for name, d in resolution.degradations.items()
        }
    if resolution.cascades:
        config["cascade"] = {name: cascade_entry(c) for name, c in resolution.cascades.items()}
    if resolution.semantic_cache is not None:
        config["semantic_cache"] = dict(resolution.semantic_cache)
    limits = router_features.rate_limits_section(spec.router.rate_limits)
    if limits is not None:
        config["rate_limits"] = limits
    return config


def cascade_entry(c: CascadeSpec) -> dict[str, Json]:
    """A model's `cascade:` entry, in the router's words (kvflow.router.cascade.config)."""
    checks: dict[str, Json] = {
        "json_when_response_format": c.checks.json_when_response_format,
        "refusal_patterns": list(c.checks.refusal_patterns),
    }
    if c.checks.min_mean_logprob is not None:
        checks["min_mean_logprob"] = c.checks.min_mean_logprob
    return {"small": c.small, "large": c.large, "checks": checks}


def degradation_entry(d: DegradationSpec) -> dict[str, Json]:
    """A model's `degradation:` entry, in the router's words (kvflow.router.degrade.config)."""
    entry: dict[str, Json] = {
        "steps": list(d.steps),
        "ttft_slo_s": d.slo.ttft_target_ms / 1000,
        "tpot_slo_s": d.slo.tpot_target_ms / 1000,
        "slo_percentile": d.slo.percentile,
        "window_s": d.window_seconds,
        "engage_burn": d.engage_burn,
        "release_burn": d.release_burn,
        "engage_queue_s": d.engage_queue_seconds,
        "release_queue_s": d.release_queue_seconds,
        "engage_after_s": d.engage_after_seconds,
        "release_after_s": d.release_after_seconds,
        "reengage_window_s": d.reengage_window_seconds,
        "max_release_after_s": d.max_release_after_seconds,
        "release_offered_ratio": d.release_offered_ratio,
        "min_requests": d.min_requests,
    }
    optional = {"max_tokens_cap": d.max_tokens_cap, "fallback_model": d.fallback_model,
                "queue_deadline_s": d.queue_deadline_seconds}  # fmt: skip
    entry.update({k: v for k, v in optional.items() if v is not None})
    return entry


def config_text(config: Mapping[str, Json]) -> str:
    return yaml.safe_dump(dict(config), sort_keys=False)


def gateway_configmap(gateway: GatewayRef, text: str) -> dict[str, Json]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(gateway, gateway_workload_name(gateway)),
        "data": {CONFIG_KEY: text},
    }


def worker_token(
    used: Sequence[str], pools: Mapping[str, v1alpha1.InferencePoolSpec]
) -> tuple[v1alpha1_router.SecretKeyRef | None, list[str]]:
    """The worker token the gateway presents (a router has one), and the problem when the
    pools it fronts use different ones (each pool without a workerTokenSecret has its own
    generated one, so pools behind one gateway name a shared Secret key)."""
    refs = {name: effective_worker_token(name, pools[name]) for name in used}
    distinct = sorted({(r.name, r.key) for r in refs.values()})
    if len(distinct) <= 1:
        return next(iter(refs.values()), None), []
    holders = ", ".join(f"{name} ({r.name}/{r.key})" for name, r in sorted(refs.items()))
    return next(iter(refs.values())), [
        f"pools use different worker tokens ({holders}); a gateway presents one token, "
        "so give them the same workerTokenSecret"
    ]


def gateway_deployment(
    gateway: GatewayRef,
    spec: gw.InferenceGatewaySpec,
    images: Images,
    text: str,
    used: Sequence[str],
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
) -> dict[str, Json]:
    volumes: list[tuple[dict[str, Json], dict[str, Json]]] = []
    for name in used:
        found = pods.model_volume(pools[name].model)
        if found is not None:
            volume, mount = found
            volumes.append(
                (
                    {**volume, "name": f"model-{name}"},
                    {**mount, "name": f"model-{name}", "mountPath": pool_model_mount(name)},
                )
            )
        tls = pods.worker_tls_volume(pools[name].worker_tls)
        if tls is not None:
            volume, mount = tls
            volumes.append(
                (
                    {**volume, "name": f"tls-{name}"},
                    {**mount, "name": f"tls-{name}", "mountPath": pool_tls_mount(name)},
                )
            )
    token, _ = worker_token(used, pools)
    env = [] if token is None else pods.router_secret_env(token)
    gateway_scope = ["--quota-scope", f"{gateway.namespace}/gateway/{gateway.name}"]
    deployment = router_workload(
        RouterPod(
            meta=metadata(gateway, gateway_workload_name(gateway)),
            select=selector_labels(gateway),
            config_map=gateway_workload_name(gateway),
            config_text=text,
            # Quota keys per gateway (its tenants are its own, not its pools').
            args=[*listen_args(), *gateway_scope, *shared_args(spec.router)],
            env=env,
            volumes=volumes,
            pod_labels={fronts_label(name): "true" for name in used},
        ),
        spec.router,
        images,
    )
    if not used:
        deployment["spec"]["replicas"] = 0  # nothing to serve; a router needs a pool
    return deployment


def gateway_service(gateway: GatewayRef, router: v1alpha1_router.RouterSpec) -> dict[str, Json]:
    """What tenants call: the OpenAI API of the gateway's routers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(gateway, gateway_service_name(gateway)),
        "spec": {
            "type": router.service_type,
            "selector": selector_labels(gateway),
            "ports": [
                {
                    "name": "http",
                    "port": router.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                    "appProtocol": "http",
                }
            ],
        },
    }


def gateway_budget(gateway: GatewayRef) -> dict[str, Json]:
    """One router evicted at a time (as a pool's router budget)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(gateway, gateway_workload_name(gateway)),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(gateway)}},
    }


def gateway_network_policy(
    gateway: GatewayRef, scrapers: MetricsScrapers = NO_SCRAPERS
) -> dict[str, Json]:
    """Its routers take requests (8000) and scrapes (9401, from ``scrapers``) only, as a
    pool's do."""
    return router_ingress_policy(
        metadata(gateway, gateway_workload_name(gateway)), selector_labels(gateway), scrapers
    )


def desired_gateway_children(
    gateway: GatewayRef,
    spec: gw.InferenceGatewaySpec,
    images: Images,
    resolution: Resolution,
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
    scrapers: MetricsScrapers = NO_SCRAPERS,
) -> list[dict[str, Json]]:
    """In apply order: config and Service before the Deployment that uses them."""
    text = config_text(gateway_config(gateway.namespace, spec, resolution, pools))
    return [
        gateway_configmap(gateway, text),
        gateway_service(gateway, spec.router),
        gateway_deployment(gateway, spec, images, text, resolution.pools, pools),
        gateway_budget(gateway),
        gateway_network_policy(gateway, scrapers),
    ]
