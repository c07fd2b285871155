"""A worker Deployment per role of a pool (pure)."""

from __future__ import annotations

from kvflow.operator.api import v1alpha1, v1alpha1_workers
from kvflow.operator.api.schema import Json
from kvflow.operator.builders import pods
from kvflow.operator.builders.names import (
    WORKER_GRPC_PORT,
    WORKER_KV_PORT,
    WORKER_METRICS_PORT,
    Images,
    PoolRef,
    WorkerRole,
    metadata,
    selector_labels,
    worker_deployment_name,
    workers_tls_name,
)
from kvflow.operator.builders.worker_token import effective_worker_token

# Loading a 70B model from a network volume can take several minutes: the startup probe
# allows 10 minutes (120 x 5 s) before liveness starts to count.
STARTUP_PERIOD_S = 5
STARTUP_FAILURES = 120
# After its drain a worker stops gRPC with a 1 s grace and exits; 5 s leaves room for that
# on a busy node before the kubelet's SIGKILL.
STOP_MARGIN_S = 5


def worker_args(
    spec: v1alpha1.InferencePoolSpec, role: WorkerRole, gpus: int, *, tls_name: str = ""
) -> list[str]:
    """The `kvflow worker` command line (the worker's CLI contract).

    Prefill and decode workers also get their KV transport and the address peers reach
    their KV port at: the pod's IP (Kubernetes expands $(POD_IP) from the env below), since
    the 0.0.0.0 they listen on is no address a peer can dial. With spec.workerTls their
    TCP KV port runs mutual TLS from the same files as gRPC (the worker's --kv-tls auto),
    and a sender checks the receiver's certificate against ``tls_name``
    (names.workers_tls_name), since it dials a pod IP.
    """
    if spec.task == "embed":
        return embed_worker_args(spec, gpus)
    engine, model = spec.engine, spec.model
    args = ["worker"]
    path = pods.model_path(model)
    if path:
        args += ["--model", path]
    args += [
        "--served-model-name", model.served_name,
        "--host", "0.0.0.0",
        "--port", str(WORKER_GRPC_PORT),
        "--metrics-port", str(WORKER_METRICS_PORT),
        "--role", role,
        "--device", "cuda" if gpus > 0 else "cpu",
        "--dtype", model.dtype,
        "--block-size", str(engine.block_size),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--max-model-len", str(model.max_model_len),
        "--kv-cache-dtype", engine.kv_cache_dtype,
    ]  # fmt: skip
    # Unset, a CPU worker's cache is 1 GiB and a GPU worker's what the utilization leaves.
    if engine.kv_cache_gib is not None:
        args += ["--kv-cache-gib", f"{engine.kv_cache_gib:g}"]
    if gpus > 0 and not engine.simulate:
        args += ["--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    args += ["--drain-timeout-s", str(engine.drain_timeout_seconds)]
    if gpus > 1:  # one worker over the pod's GPUs: the model split among them
        args += ["--tensor-parallel-size", str(gpus)]
    if role != "colocated":
        args += [
            "--kv-transport", spec.kv_transport,
            "--kv-port", str(WORKER_KV_PORT),
            "--advertise-host", f"$({pods.POD_IP_ENV})",
        ]  # fmt: skip
    if spec.worker_tls is not None:
        args += pods.worker_tls_server_args()
        if role != "colocated":
            assert tls_name, "a pool with workerTls names its workers' certificate"
            args += ["--kv-tls-server-name", tls_name]
    if engine.simulate:
        args.append("--simulate")
    return args + list(engine.extra_args)


def embed_worker_args(spec: v1alpha1.InferencePoolSpec, gpus: int) -> list[str]:
    """An embedding pool's `kvflow worker --task embed`: no engine flags (it runs none) and
    no --model (the image's one embedding model is the worker's default; the CRD refuses
    a model path for task embed)."""
    limits = spec.embedding
    args = [
        "worker", "--task", "embed",
        "--served-model-name", spec.model.served_name,
        "--host", "0.0.0.0",
        "--port", str(WORKER_GRPC_PORT),
        "--metrics-port", str(WORKER_METRICS_PORT),
        "--device", "cuda" if gpus > 0 else "cpu",
        "--max-embedding-inputs", str(limits.max_inputs_per_request),
        "--max-embedding-input-tokens", str(limits.max_input_tokens),
        "--drain-timeout-s", str(spec.engine.drain_timeout_seconds),
    ]  # fmt: skip
    if spec.worker_tls is not None:
        args += pods.worker_tls_server_args()
    return args + list(spec.engine.extra_args)


def worker_ports(role: WorkerRole) -> list[Json]:
    ports: list[Json] = [
        {"name": "grpc", "containerPort": WORKER_GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"},
    ]
    if role != "colocated":
        ports.append({"name": "kv", "containerPort": WORKER_KV_PORT, "protocol": "TCP"})
    return ports


def worker_deployment(
    pool: PoolRef,
    spec: v1alpha1.InferencePoolSpec,
    role: WorkerRole,
    role_spec: v1alpha1_workers.RoleSpec,
    images: Images,
    replicas: int | None,
) -> dict[str, Json]:
    """The role's Deployment; `replicas` None leaves the count out, to whoever scales it."""
    engine = spec.engine
    gpus = role_spec.gpus_per_pod
    select = selector_labels(pool, role)
    meta = metadata(pool, worker_deployment_name(pool, role), "worker", role)

    scratch, scratch_mount = pods.scratch_volume()
    volumes, mounts = [scratch], [scratch_mount]
    model_volume = pods.model_volume(spec.model)
    if model_volume is not None:
        volumes.append(model_volume[0])
        mounts.append(model_volume[1])
    tls_volume = pods.worker_tls_volume(spec.worker_tls)
    if tls_volume is not None:
        volumes.append(tls_volume[0])
        mounts.append(tls_volume[1])
    if gpus > 0:
        shm, shm_mount = pods.shared_memory_volume()
        volumes.append(shm)
        mounts.append(shm_mount)

    container: dict[str, Json] = {
        "name": "worker",
        "image": engine.image or images.worker,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["kvflow"],
        "args": worker_args(spec, role, gpus, tls_name=workers_tls_name(pool)),
        "ports": worker_ports(role),
        "env": [
            *pods.common_env(),
            {"name": "KVFLOW_POOL", "value": pool.name},
            *pods.worker_token_env(effective_worker_token(pool.name, spec)),
            *pods.tracing_env(pool.name, spec),
        ],
        "resources": pods.resources(role_spec.resources, gpus),
        "startupProbe": pods.http_probe("/health", "metrics", STARTUP_PERIOD_S, STARTUP_FAILURES),
        "livenessProbe": pods.http_probe("/health", "metrics", 10, 3),
        "readinessProbe": pods.http_probe("/ready", "metrics", 5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": pods.PRESTOP_SLEEP_S}}},
        "securityContext": pods.container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec = pods.pod_spec(
        container=container,
        volumes=volumes,
        select=select,
        # SIGTERM makes the worker refuse new requests and finish in-flight ones for up to
        # --drain-timeout-s; then it stops its servers (about a second) and exits.
        grace_s=pods.PRESTOP_SLEEP_S + engine.drain_timeout_seconds + STOP_MARGIN_S,
        run_as_uid=images.run_as_uid,
        node_selector=role_spec.node_selector,
        tolerations=role_spec.tolerations,
        affinity=role_spec.affinity,
    )

    deployment_spec: dict[str, Json] = {
        "selector": {"matchLabels": dict(select)},
        # Surge one pod, never go below the replica count: a worker that is still
        # loading its model serves nothing, so taking one down first halves capacity.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": STARTUP_PERIOD_S * STARTUP_FAILURES + 120,
        "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod_spec},
    }
    if replicas is not None:
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": deployment_spec,
    }
