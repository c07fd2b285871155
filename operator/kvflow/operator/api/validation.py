"""Checks of a pool's spec that the CRD's schema cannot express (pure).

The API server rejects what the schema and its CEL rules can judge. What is left (quantity
arithmetic, flags the operator owns) is found here, before any child is touched, and
reported in the pool's status (Degraded, reason InvalidSpec) instead of failing later when
a Deployment is refused or a worker crashes on start.
"""

from __future__ import annotations

from kvflow.operator.api import v1alpha1, v1alpha1_model, v1alpha1_router, v1alpha1_workers
from kvflow.operator.api.quantity import QuantityError, parse_quantity

GIB = 2**30
# What a CPU worker's cache is without kvCacheGiB (`kvflow worker`'s default).
CPU_DEFAULT_KV_CACHE_GIB = 1.0

# `kvflow worker` flags the operator sets itself; extraArgs may not override them.
OWNED_WORKER_FLAGS = frozenset(
    {
        "--model", "--served-model-name", "--host", "--port", "--metrics-port", "--role",
        "--device", "--dtype", "--block-size", "--max-num-batched-tokens", "--max-num-seqs",
        "--max-model-len", "--kv-cache-gib", "--simulate", "--drain-timeout-s",
        "--kv-transport", "--kv-port", "--advertise-host", "--kv-cache-dtype",
        "--gpu-memory-utilization", "--tensor-parallel-size", "-tp", "--kv-tls-server-name",
        "--task", "--max-embedding-inputs", "--max-embedding-input-tokens",
    }
)  # fmt: skip


def spec_problems(spec: v1alpha1.InferencePoolSpec) -> list[str]:
    """What is wrong with a spec the API server accepted; empty when it can be deployed."""
    problems: list[str] = []
    if spec.mode == "disaggregated" and (spec.prefill is None or spec.decode is None):
        problems.append("mode disaggregated needs both prefill and decode")
    problems += _extra_args_problems(spec.engine.extra_args)
    if spec.engine.simulate and spec.engine.kv_cache_dtype != "auto":
        problems.append(
            f"engine.kvCacheDtype {spec.engine.kv_cache_dtype} needs a model: a simulated "
            "worker has no KV cache to quantize (set it to auto or turn simulate off)"
        )
    for where, role in _roles(spec):
        problems += _resource_problems(f"{where}.resources", role.resources)
        if "nvidia.com/gpu" in {**role.resources.requests, **role.resources.limits}:
            problems.append(f"{where}: request GPUs with gpusPerPod, not in resources")
        if spec.task == "generate":  # an embedding worker has no KV cache
            problems += _kv_cache_problems(where, role, spec.engine.kv_cache_gib)
        problems += _tensor_parallel_problems(where, role, spec.model)
    problems += _resource_problems("router.resources", spec.router.resources)
    return problems


def auth_problems(router: v1alpha1_router.RouterSpec) -> list[str]:
    """The CRD's rules on authentication (v1alpha1_router.ROUTER_AUTH_RULES), checked again: a pool
    stored before the CRD had them, or under an older CRD, is not deployed open either."""
    if router.tenants_secret is None and not router.allow_unauthenticated:
        return [
            "router.tenantsSecret is not set: the gateway would let every caller in as an "
            "administrator with no quota; set tenantsSecret, or router.allowUnauthenticated: "
            "true (ClusterIP Services only)"
        ]
    if router.allow_unauthenticated and router.service_type != "ClusterIP":
        return [
            f"router.allowUnauthenticated with serviceType {router.service_type}: an "
            "unauthenticated gateway is never exposed outside the cluster"
        ]
    return []


def router_problems(router: v1alpha1_router.RouterSpec) -> list[str]:
    """What is wrong with an InferenceGateway's router that its schema let through."""
    return _resource_problems("router.resources", router.resources)


def _roles(spec: v1alpha1.InferencePoolSpec) -> list[tuple[str, v1alpha1_workers.RoleSpec]]:
    if spec.mode == "colocated":
        return [("colocated", spec.colocated)]
    return [(name, r) for name, r in (("prefill", spec.prefill), ("decode", spec.decode)) if r]


def _extra_args_problems(extra_args: list[str]) -> list[str]:
    owned = sorted({name for arg in extra_args if _is_owned(name := arg.split("=", 1)[0])})
    if not owned:
        return []
    return [f"engine.extraArgs sets {', '.join(owned)}, which the operator sets from the spec"]


def _is_owned(name: str) -> bool:
    """An owned flag, or an abbreviation of one: the worker's argparse reads a unique prefix
    (`--rol`) as the whole flag (`--role`)."""
    if name in OWNED_WORKER_FLAGS:
        return True
    return (
        name.startswith("--")
        and len(name) > 2
        and any(flag.startswith(name) for flag in OWNED_WORKER_FLAGS)
    )


def _resource_problems(where: str, resources: v1alpha1_workers.Resources) -> list[str]:
    problems: list[str] = []
    parsed: dict[str, dict[str, object]] = {"requests": {}, "limits": {}}
    for kind, values in (("requests", resources.requests), ("limits", resources.limits)):
        for name, text in values.items():
            try:
                parsed[kind][name] = parse_quantity(text)
            except QuantityError as exc:
                problems.append(f"{where}.{kind}.{name}: {exc}")
    for name, limit in parsed["limits"].items():
        request = parsed["requests"].get(name)
        if request is not None and request > limit:  # type: ignore[operator]
            problems.append(
                f"{where}: requests.{name} ({resources.requests[name]}) exceeds "
                f"limits.{name} ({resources.limits[name]})"
            )
    return problems


# The built-in model's heads, which gpusPerPod must divide (the worker checks any model as
# it loads it; the built-in one the operator knows): SmolLM2-135M-Instruct has 9 attention
# heads and 3 KV heads.
BUILTIN_MODEL_SPLITS = (1, 3)


def _tensor_parallel_problems(
    where: str, role: v1alpha1_workers.RoleSpec, model: v1alpha1_model.ModelSpec
) -> list[str]:
    """gpusPerPod above 1 splits the model over the pod's GPUs (--tensor-parallel-size)."""
    gpus = role.gpus_per_pod
    if gpus <= 1:
        return []
    if not model.path and gpus not in BUILTIN_MODEL_SPLITS:
        return [
            f"{where}.gpusPerPod {gpus}: the built-in SmolLM2-135M-Instruct (9 attention "
            "heads, 3 KV heads) splits over 1 or 3 GPUs only"
        ]
    return []


def _kv_cache_problems(
    where: str, role: v1alpha1_workers.RoleSpec, kv_cache_gib: float | None
) -> list[str]:
    """On CPU the KV cache lives in the container's memory, which the limit caps (a worker
    also checks it at start, against the cgroup's limit, with its weights and activations)."""
    if role.gpus_per_pod > 0 or "memory" not in role.resources.limits:
        return []
    if kv_cache_gib is None:
        kv_cache_gib = CPU_DEFAULT_KV_CACHE_GIB
        what = f"engine.kvCacheGiB (unset: {kv_cache_gib:g} GiB on CPU)"
    else:
        what = f"engine.kvCacheGiB ({kv_cache_gib:g})"
    try:
        limit_bytes = parse_quantity(role.resources.limits["memory"])
    except QuantityError:
        return []  # reported by _resource_problems
    if kv_cache_gib * GIB >= limit_bytes:
        return [
            f"{what} does not fit in {where}.resources.limits."
            f"memory ({role.resources.limits['memory']}); raise the limit or lower the cache"
        ]
    return []
