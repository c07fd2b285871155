"""Names, labels and ownership shared by every object built for a pool (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api import v1alpha1, v1alpha1_workers
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_planner import WorkerRoleName

MANAGED_BY = "kvflow-operator"
LABEL_POOL = "kvflow.io/pool"
LABEL_ROLE = "kvflow.io/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
FRONTS_LABEL_PREFIX = "fronts.kvflow.io/"

# The worker's ports (the `kvflow worker` contract) and the router's. The KV port (the
# worker's KV receiver and rendezvous store) is opened by prefill and decode workers only.
WORKER_GRPC_PORT = 50051
WORKER_KV_PORT = 50052
WORKER_METRICS_PORT = 9400
ROUTER_HTTP_PORT = 8000
# Off the API port: tenants reach 8000 through the gateway Service, never this one.
ROUTER_METRICS_PORT = 9401

# Non-root uid/gid baked into every kvflow image (docker/*.Dockerfile).
IMAGE_UID = 10001

# The words of kvflow.proto.roles.Role: the CRD, `kvflow worker --role` and the wire agree
# (tests/contracts/test_roles.py).
WorkerRole = WorkerRoleName
Component = Literal["worker", "router"]


@dataclass(frozen=True)
class PoolRef:
    """The identity of the pool that owns the objects being built."""

    name: str
    namespace: str
    uid: str
    generation: int = 0


@dataclass(frozen=True)
class Images:
    """Default images, used where a pool does not name its own, and the user their pods
    run as (operator flags)."""

    worker: str
    router: str
    # The pods' user and group (and fsGroup): the images' own. None: the pods name none
    # and the platform picks (OpenShift's restricted SCC one from the namespace's range;
    # elsewhere the image's numeric USER runs, non-root all the same).
    run_as_uid: int | None = IMAGE_UID


def worker_deployment_name(pool: PoolRef, role: WorkerRole) -> str:
    return f"{pool.name}-{role}"


def router_name(pool: PoolRef) -> str:
    return f"{pool.name}-router"


def gateway_service_name(pool: PoolRef) -> str:
    return f"{pool.name}-gateway"


def workers_service_name(pool: PoolRef) -> str:
    return f"{pool.name}-workers"


def workers_tls_name(pool: PoolRef) -> str:
    """The name the pool's worker certificate carries (spec.workerTls): workers are dialled
    by pod IP, by routers over gRPC and by each other over the KV port, and checked
    against this name instead."""
    return f"{workers_service_name(pool)}.{pool.namespace}.svc"


def gateway_endpoint(pool: PoolRef, port: int) -> str:
    host = f"{gateway_service_name(pool)}.{pool.namespace}.svc"
    return f"http://{host}/v1" if port == 80 else f"http://{host}:{port}/v1"


def fronts_label(pool_name: str) -> str:
    """Carried by the pods of an InferenceGateway that routes to the pool: the pool's
    NetworkPolicy lets them reach its workers."""
    return f"{FRONTS_LABEL_PREFIX}{pool_name}"


def selector_labels(pool: PoolRef, role: str) -> dict[str, str]:
    """Labels a Deployment selects its pods by; never change them (selectors are immutable)."""
    return {LABEL_POOL: pool.name, LABEL_ROLE: role}


def pool_labels(pool: PoolRef) -> dict[str, str]:
    """What the operator lists a pool's children by."""
    return {LABEL_POOL: pool.name, LABEL_MANAGED_BY: MANAGED_BY}


def labels(pool: PoolRef, component: Component, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"kvflow-{component}",
        "app.kubernetes.io/instance": pool.name,
        "app.kubernetes.io/part-of": "kvflow",
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(pool, role),
    }


def metadata(
    pool: PoolRef, name: str, component: Component, role: str, **extra: Json
) -> dict[str, Json]:
    """Object metadata with the pool as controlling owner, so deleting the pool collects it."""
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": labels(pool, component, role),
        "ownerReferences": [
            {
                "apiVersion": v1alpha1.API_VERSION,
                "kind": v1alpha1.KIND,
                "name": pool.name,
                "uid": pool.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
        **extra,
    }


def worker_roles(
    spec: v1alpha1.InferencePoolSpec,
) -> list[tuple[WorkerRole, v1alpha1_workers.RoleSpec]]:
    """The worker roles the pool's mode asks for, each with its settings."""
    if spec.mode == "colocated":
        return [("colocated", spec.colocated)]
    assert spec.prefill is not None and spec.decode is not None, "the CRD's CEL rule allows none"
    return [("prefill", spec.prefill), ("decode", spec.decode)]
