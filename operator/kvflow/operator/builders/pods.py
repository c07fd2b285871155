"""Pod-level pieces every kvflow Deployment shares: security, volumes, probes (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.operator.api import v1alpha1, v1alpha1_model, v1alpha1_router, v1alpha1_workers
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import IMAGE_UID

MODEL_MOUNT = "/models"
GPU_RESOURCE = "nvidia.com/gpu"

# Endpoints controllers and kube-proxy need a moment to drop a terminating pod; sleeping
# before SIGTERM keeps new requests from arriving at a process that already drains.
PRESTOP_SLEEP_S = 5

POD_IP_ENV = "POD_IP"  # from the downward API; flags name it as $(POD_IP)


def pod_security_context(run_as_uid: int | None = IMAGE_UID) -> dict[str, Json]:
    """Non-root, as ``run_as_uid`` (user, group and fsGroup); None names no user: the
    platform assigns one (OpenShift refuses pods that name a user outside the namespace's
    range), and the kubelet checks that the image's numeric USER is not root."""
    ids: dict[str, Json] = {}
    if run_as_uid is not None:
        ids = {"runAsUser": run_as_uid, "runAsGroup": run_as_uid, "fsGroup": run_as_uid}
    return {"runAsNonRoot": True, **ids, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Json]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(path: str, port: str, period_s: int, failures: int) -> dict[str, Json]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }


def resources(spec: v1alpha1_workers.Resources, gpus: int = 0) -> dict[str, Json]:
    """Container resources; GPUs go in both requests and limits (extended resources must)."""
    requests: dict[str, Json] = {k: _quantity(v) for k, v in spec.requests.items()}
    limits: dict[str, Json] = {k: _quantity(v) for k, v in spec.limits.items()}
    if gpus:
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    out: dict[str, Json] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _quantity(value: str) -> Json:
    return int(value) if value.isdigit() else value


def scratch_volume() -> tuple[dict[str, Json], dict[str, Json]]:
    """A writable /tmp (HOME and caches point there): the root filesystem is read-only."""
    return (
        {"name": "tmp", "emptyDir": {}},
        {"name": "tmp", "mountPath": "/tmp"},
    )


def model_volume(model: v1alpha1_model.ModelSpec) -> tuple[dict[str, Json], dict[str, Json]] | None:
    source = model.volume
    if source is None:
        return None
    volume: dict[str, Json] = {"name": "model"}
    if source.persistent_volume_claim is not None:
        pvc = source.persistent_volume_claim
        volume["persistentVolumeClaim"] = {"claimName": pvc.claim_name, "readOnly": pvc.read_only}
    elif source.host_path is not None:
        volume["hostPath"] = {"path": source.host_path.path, "type": "Directory"}
    return volume, {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}


WORKER_TLS_MOUNT = "/etc/kvflow-worker-tls"


def worker_tls_volume(
    tls: v1alpha1.WorkerTlsSpec | None,
) -> tuple[dict[str, Json], dict[str, Json]] | None:
    """The pool's TLS Secret (tls.crt, tls.key, ca.crt), for its workers and routers."""
    if tls is None:
        return None
    return (
        {"name": "worker-tls", "secret": {"secretName": tls.secret_name}},
        {"name": "worker-tls", "mountPath": WORKER_TLS_MOUNT, "readOnly": True},
    )


def worker_tls_server_args() -> list[str]:
    return ["--tls-cert-file", f"{WORKER_TLS_MOUNT}/tls.crt",
            "--tls-key-file", f"{WORKER_TLS_MOUNT}/tls.key",
            "--tls-ca-file", f"{WORKER_TLS_MOUNT}/ca.crt"]  # fmt: skip


def worker_tls_client_args(server_name: str) -> list[str]:
    return ["--worker-tls-ca-file", f"{WORKER_TLS_MOUNT}/ca.crt",
            "--worker-tls-cert-file", f"{WORKER_TLS_MOUNT}/tls.crt",
            "--worker-tls-key-file", f"{WORKER_TLS_MOUNT}/tls.key",
            "--worker-tls-server-name", server_name]  # fmt: skip


def model_path(model: v1alpha1_model.ModelSpec) -> str:
    """What --model gets; empty means the built-in default model (the flag is left out)."""
    if model.volume is not None and model.path:
        return f"{MODEL_MOUNT}/{model.path}"
    return model.path


def shared_memory_volume() -> tuple[dict[str, Json], dict[str, Json]]:
    """NCCL and torch's shared-memory transport need more than the runtime's 64 MiB /dev/shm."""
    return (
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "dshm", "mountPath": "/dev/shm"},
    )


def common_env() -> list[dict[str, Json]]:
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


WORKER_TOKEN_ENV = "KVFLOW_WORKER_TOKEN"  # engine_worker/auth.py reads it, the router too
# The router derives tenants' default cache salts from this secret (router/.../tenants/
# salts.py); every replica of a pool's or gateway's router must hold the same one, or
# they share no prefix cache. The pool's worker token is such a secret already: whoever
# holds it can call the workers directly, and reads nothing more through a salt.
CACHE_SALT_SECRET_ENV = "KVFLOW_CACHE_SALT_SECRET"


def worker_token_env(ref: v1alpha1_router.SecretKeyRef) -> list[dict[str, Json]]:
    """The worker token from its Secret key (`worker_token.effective_worker_token`), for
    workers and routers alike."""
    secret_ref: Json = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
    return [{"name": WORKER_TOKEN_ENV, "valueFrom": secret_ref}]


def router_secret_env(ref: v1alpha1_router.SecretKeyRef) -> list[dict[str, Json]]:
    """A router's secrets: the worker token, and the cache-salt secret derived from it."""
    secret_ref: Json = {"secretKeyRef": {"name": ref.name, "key": ref.key}}
    return [*worker_token_env(ref), {"name": CACHE_SALT_SECRET_ENV, "valueFrom": secret_ref}]


def tracing_env(pool_name: str, spec: v1alpha1.InferencePoolSpec) -> list[dict[str, Json]]:
    """OpenTelemetry's standard variables, which the router and workers read
    (docs/observability.md, "Traces"); none while the pool sets no endpoint."""
    tracing = spec.observability
    if not tracing.otlp_traces_endpoint:
        return []
    # $(POD_NAME) is expanded by Kubernetes from common_env(), listed before this.
    attributes = f"k8s.pod.name=$(POD_NAME),kvflow.pool={pool_name}"
    return [
        {"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "value": tracing.otlp_traces_endpoint},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{tracing.traces_sample_ratio:g}"},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]


def pod_spec(
    *,
    container: dict[str, Json],
    volumes: list[dict[str, Json]],
    select: dict[str, str],
    grace_s: int,
    run_as_uid: int | None,
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Mapping[str, Json]] | None = None,
    affinity: Mapping[str, Json] | None = None,
) -> dict[str, Json]:
    """The pod spec every kvflow Deployment shares: hardened, no API token, spread over nodes."""
    spec: dict[str, Json] = {
        "terminationGracePeriodSeconds": grace_s,
        "automountServiceAccountToken": False,  # neither workers nor routers call the API server
        "enableServiceLinks": False,
        "securityContext": pod_security_context(run_as_uid),
        "containers": [container],
        "volumes": volumes,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                # Spread when possible, never block scheduling (GPU nodes are scarce).
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": dict(select)},
                "matchLabelKeys": ["pod-template-hash"],
            }
        ],
    }
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if affinity:
        spec["affinity"] = dict(affinity)
    return spec
