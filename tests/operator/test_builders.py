"""Desired-state builders: exact objects for a spec (pure; no cluster)."""

from __future__ import annotations

from testkit.pool_spec import IMAGES, POOL, build, pod_of, spec_of

from kvflow.operator.builders.desired import ChildKey, deployment_roles, desired_children
from kvflow.operator.builders.router import router_config
from kvflow.operator.builders.workers import worker_args


def test_colocated_pool_children_in_apply_order() -> None:
    assert [str(k) for k in build(spec_of())] == [
        "ConfigMap p-router",
        "Service p-workers",
        "Service p-gateway",
        "Deployment p-colocated",
        "Deployment p-router",
        "PodDisruptionBudget p-colocated",
        "PodDisruptionBudget p-router",
        "NetworkPolicy p-workers",
        "NetworkPolicy p-router",
    ]


def test_only_the_pools_own_pods_reach_worker_ports_and_workers_reach_each_other_on_all() -> None:
    children = build(spec_of(mode="disaggregated", prefill={}, decode={}))
    policy = children[ChildKey("networking.k8s.io/v1", "NetworkPolicy", "p-workers")]
    spec = policy["spec"]
    # Every worker of this pool, whatever its role; not the router.
    assert spec["podSelector"]["matchLabels"] == {
        "kvflow.io/pool": "p",
        "app.kubernetes.io/component": "worker",
    }
    assert spec["policyTypes"] == ["Ingress"]
    # No metrics rule: by default no pod reaches the metrics port (test_network_policies.py).
    workers, routers = spec["ingress"]
    # The pool's own workers, on every port: the KV port and the ports gloo and NCCL pick.
    assert workers == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {"kvflow.io/pool": "p", "app.kubernetes.io/component": "worker"}
                }
            }
        ]
    }
    # The pool's router and the routers of InferenceGateways that front this pool: worker
    # gRPC only, not the KV port.
    own_router = {"kvflow.io/pool": "p", "app.kubernetes.io/component": "router"}
    assert routers["from"] == [
        {"podSelector": {"matchLabels": own_router}},
        {"podSelector": {"matchLabels": {"fronts.kvflow.io/p": "true"}}},
    ]
    assert routers["ports"] == [{"protocol": "TCP", "port": 50051}]
    # The pods it lets in carry that label: the router's and the workers'.
    for name in ("p-router", "p-prefill", "p-decode"):
        labels = children[ChildKey("apps/v1", "Deployment", name)]["spec"]["template"]["metadata"][
            "labels"
        ]
        assert labels["kvflow.io/pool"] == "p"
    assert policy["metadata"]["ownerReferences"][0]["controller"] is True


def test_disaggregated_pool_has_a_deployment_and_budget_per_role() -> None:
    children = build(spec_of(mode="disaggregated", prefill={"replicas": 2}, decode={"replicas": 3}))
    deployments = {
        k.name: o["spec"]["replicas"] for k, o in children.items() if k.kind == "Deployment"
    }
    assert deployments == {"p-prefill": 2, "p-decode": 3, "p-router": 1}
    budgets = sorted(k.name for k in children if k.kind == "PodDisruptionBudget")
    assert budgets == ["p-decode", "p-prefill", "p-router"]
    assert deployment_roles(POOL, spec_of(mode="disaggregated", prefill={}, decode={})) == {
        "p-prefill": "prefill",
        "p-decode": "decode",
        "p-router": "router",
    }


def test_every_child_is_owned_by_the_pool_and_labelled() -> None:
    for key, obj in build(spec_of()).items():
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvflow.io/v1alpha1",
                "kind": "InferencePool",
                "name": "p",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], key
        assert meta["labels"]["kvflow.io/pool"] == "p"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvflow-operator"


def test_worker_command_line_follows_the_worker_contract() -> None:
    spec = spec_of(
        model={"servedName": "m", "dtype": "bfloat16", "maxModelLen": 8192},
        engine={"kvCacheGiB": 2.5, "simulate": True, "extraArgs": ["--seed", "1"]},
    )
    assert worker_args(spec, "colocated", gpus=0) == [
        "worker",
        "--served-model-name", "m",
        "--host", "0.0.0.0",
        "--port", "50051",
        "--metrics-port", "9400",
        "--role", "colocated",
        "--device", "cpu",
        "--dtype", "bfloat16",
        "--block-size", "16",
        "--max-num-batched-tokens", "2048",
        "--max-num-seqs", "64",
        "--max-model-len", "8192",
        "--kv-cache-dtype", "auto",
        "--kv-cache-gib", "2.5",
        "--drain-timeout-s", "120",
        "--simulate",
        "--seed", "1",
    ]  # fmt: skip


def test_prefill_and_decode_workers_get_their_role_transport_and_kv_address() -> None:
    spec = spec_of(mode="disaggregated", prefill={}, decode={}, kvTransport="gloo")
    children = build(spec)
    for role in ("prefill", "decode"):
        (container,) = pod_of(children, f"p-{role}")["containers"]
        args = container["args"]
        assert args[args.index("--role") + 1] == role
        assert args[-6:] == [
            "--kv-transport", "gloo",
            "--kv-port", "50052",
            "--advertise-host", "$(POD_IP)",
        ]  # fmt: skip
        # Kubernetes expands $(POD_IP) only from the container's own env.
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "KVFLOW_KV_TRANSPORT" not in env
        assert {"name": "kv", "containerPort": 50052, "protocol": "TCP"} in container["ports"]
    assert spec_of().kv_transport == "auto"


def test_colocated_workers_get_no_kv_transport() -> None:
    (container,) = pod_of(build(spec_of(kvTransport="gloo")), "p-colocated")["containers"]
    assert not {"--kv-transport", "--kv-port", "--advertise-host"} & set(container["args"])
    assert [p["name"] for p in container["ports"]] == ["grpc", "metrics"]


def test_cpu_worker_pod_is_hardened_probed_and_drains() -> None:
    pod = pod_of(build(spec_of(engine={"drainTimeoutSeconds": 60})), "p-colocated")
    (container,) = pod["containers"]
    assert container["image"] == "img/worker:1"
    assert container["command"] == ["kvflow"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert (
        container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"]
        == 600
    )
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    # preStop sleep 5 s + --drain-timeout-s 60 + 5 s to stop the servers and exit.
    assert container["args"][container["args"].index("--drain-timeout-s") + 1] == "60"
    assert pod["terminationGracePeriodSeconds"] == 70
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["automountServiceAccountToken"] is False
    assert "resources" not in container or container["resources"] == {}
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == {
        "kvflow.io/pool": "p",
        "kvflow.io/role": "colocated",
    }


def test_gpu_worker_requests_gpus_and_gets_shared_memory_and_the_model_volume() -> None:
    spec = spec_of(
        model={
            "servedName": "m",
            "path": "llama",
            "volume": {"persistentVolumeClaim": {"claimName": "models"}},
        },
        colocated={
            "gpusPerPod": 2,
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    )
    pod = pod_of(build(spec), "p-colocated")
    (container,) = pod["containers"]
    assert container["resources"] == {
        "requests": {"cpu": 8, "memory": "64Gi", "nvidia.com/gpu": 2},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 2},
    }
    args = container["args"]
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--tensor-parallel-size") + 1] == "2"  # the model over both GPUs
    assert args[args.index("--model") + 1] == "/models/llama"
    # The cache is what the utilization leaves once the worker has measured itself.
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--kv-cache-gib" not in args
    assert {v["name"]: v for v in pod["volumes"]}["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]


def test_memory_and_kv_dtype_flags_follow_the_engine_spec() -> None:
    engine = {"kvCacheDtype": "int8", "gpuMemoryUtilization": 0.8}
    gpu = worker_args(spec_of(engine=engine), "decode", gpus=1)
    assert gpu[gpu.index("--kv-cache-dtype") + 1] == "int8"
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "--kv-cache-gib" not in gpu
    sized = worker_args(spec_of(engine={**engine, "kvCacheGiB": 30}), "decode", gpus=1)
    assert sized[sized.index("--kv-cache-gib") + 1] == "30"  # the worker's override
    # A CPU worker sizes by --kv-cache-gib alone (1 GiB unset); utilization is a GPU's.
    cpu = worker_args(spec_of(engine=engine), "colocated", gpus=0)
    assert "--gpu-memory-utilization" not in cpu and "--kv-cache-gib" not in cpu
    assert cpu[cpu.index("--kv-cache-dtype") + 1] == "int8"
    assert spec_of().engine.kv_cache_dtype == "auto"
    assert spec_of().engine.kv_cache_gib is None


def test_services_select_the_right_pods() -> None:
    children = build(spec_of(router={"serviceType": "LoadBalancer", "port": 8080}))
    workers = children[ChildKey("v1", "Service", "p-workers")]["spec"]
    assert workers["clusterIP"] == "None"
    assert workers["selector"] == {"kvflow.io/pool": "p", "app.kubernetes.io/component": "worker"}
    gateway = children[ChildKey("v1", "Service", "p-gateway")]["spec"]
    assert gateway["type"] == "LoadBalancer"
    assert gateway["selector"] == {"kvflow.io/pool": "p", "kvflow.io/role": "router"}
    assert gateway["ports"][0]["port"] == 8080
    budget = children[ChildKey("policy/v1", "PodDisruptionBudget", "p-router")]["spec"]
    assert budget == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"kvflow.io/pool": "p", "kvflow.io/role": "router"}},
    }


def test_builders_do_not_share_mutable_state() -> None:
    spec = spec_of()
    deployment = desired_children(POOL, spec, IMAGES)[3]
    deployment["spec"]["template"]["metadata"]["labels"]["x"] = "y"
    deployment["spec"]["selector"]["matchLabels"]["z"] = "y"
    assert "x" not in deployment["metadata"]["labels"]
    assert (
        "z"
        not in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0][
            "labelSelector"
        ]["matchLabels"]
    )
    assert "x" not in spec.colocated.node_selector


def test_router_config_has_the_disaggregation_policy_only_when_disaggregated() -> None:
    assert "disaggregation" not in router_config(spec_of())
    policy = {"minRemotePrefillTokens": 256, "transferTimeoutSeconds": 2.5}
    colocated = spec_of(router={"disaggregation": policy})
    assert "disaggregation" not in router_config(colocated)  # a colocated router never changes
    spec = spec_of(mode="disaggregated", prefill={}, decode={}, router={"disaggregation": policy})
    assert router_config(spec)["disaggregation"] == {
        "enabled": True,
        "min_remote_prefill_tokens": 256,
        "transfer_timeout_s": 2.5,  # unset fields keep the router's defaults
    }
    bare = spec_of(mode="disaggregated", prefill={}, decode={})
    assert router_config(bare)["disaggregation"] == {"enabled": True}


def test_a_worker_token_secret_reaches_workers_and_routers_and_nothing_else() -> None:
    ref = {"name": "pool-token", "key": "token"}
    children = build(spec_of(mode="disaggregated", prefill={}, decode={}, workerTokenSecret=ref))
    want = {"name": "KVFLOW_WORKER_TOKEN", "valueFrom": {"secretKeyRef": ref}}
    for name in ("p-prefill", "p-decode", "p-router"):
        (container,) = pod_of(children, name)["containers"]
        assert want in container["env"], name
    # Without one, the Secret the operator generates for the pool, wired alike.
    generated = {"name": "p-worker-token", "key": "token"}
    plain = build(spec_of())
    for name in ("p-colocated", "p-router"):
        (container,) = pod_of(plain, name)["containers"]
        want = {"name": "KVFLOW_WORKER_TOKEN", "valueFrom": {"secretKeyRef": generated}}
        assert want in container["env"], name


def test_routers_take_requests_from_anywhere_and_nothing_else_by_default() -> None:
    children = build(spec_of())
    policy = children[ChildKey("networking.k8s.io/v1", "NetworkPolicy", "p-router")]
    assert policy["spec"] == {
        "podSelector": {
            "matchLabels": {"kvflow.io/pool": "p", "app.kubernetes.io/component": "router"}
        },
        "policyTypes": ["Ingress"],
        # The metrics port (9401) admits the scrapers' namespaces only: none by default.
        "ingress": [{"ports": [{"protocol": "TCP", "port": 8000}]}],
    }
    (container,) = pod_of(children, "p-router")["containers"]
    assert sorted(p["containerPort"] for p in container["ports"]) == [8000, 9401]


def test_worker_tls_mounts_the_secret_and_wires_both_ends() -> None:
    spec = spec_of(workerTls={"secretName": "pool-tls"})
    children = build(spec)
    mount = "/etc/kvflow-worker-tls"
    worker = pod_of(children, "p-colocated")
    args = worker["containers"][0]["args"]
    assert args[args.index("--tls-cert-file") + 1] == f"{mount}/tls.crt"
    assert args[args.index("--tls-key-file") + 1] == f"{mount}/tls.key"
    assert args[args.index("--tls-ca-file") + 1] == f"{mount}/ca.crt"
    router = pod_of(children, "p-router")
    rargs = router["containers"][0]["args"]
    assert rargs[rargs.index("--worker-tls-ca-file") + 1] == f"{mount}/ca.crt"
    assert rargs[rargs.index("--worker-tls-cert-file") + 1] == f"{mount}/tls.crt"
    # Workers are dialled by pod IP; the certificate names the headless Service.
    assert rargs[rargs.index("--worker-tls-server-name") + 1] == "p-workers.ns.svc"
    for pod in (worker, router):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["worker-tls"]["secret"] == {"secretName": "pool-tls"}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["worker-tls"] == {"name": "worker-tls", "mountPath": mount, "readOnly": True}
    # Unset: plaintext, nothing mounted.
    plain = build(spec_of())
    assert "--tls-cert-file" not in pod_of(plain, "p-colocated")["containers"][0]["args"]
    assert "--worker-tls-ca-file" not in pod_of(plain, "p-router")["containers"][0]["args"]


def test_worker_tls_covers_the_kv_port_of_a_disaggregated_pool() -> None:
    """The worker runs mutual TLS on its TCP KV port from the gRPC files (--kv-tls auto);
    senders dial pod IPs, so they check receivers against the certificate's Service name."""
    mount = "/etc/kvflow-worker-tls"
    tls = {"workerTls": {"secretName": "pool-tls"}}
    children = build(spec_of(mode="disaggregated", prefill={}, decode={}, **tls))
    for role in ("prefill", "decode"):
        pod = pod_of(children, f"p-{role}")
        args = pod["containers"][0]["args"]
        assert args[args.index("--tls-cert-file") + 1] == f"{mount}/tls.crt"
        assert args[args.index("--tls-key-file") + 1] == f"{mount}/tls.key"
        assert args[args.index("--tls-ca-file") + 1] == f"{mount}/ca.crt"
        assert args[args.index("--kv-tls-server-name") + 1] == "p-workers.ns.svc"
        assert "--kv-tls" not in args  # auto: on, as gRPC runs mutual TLS
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["worker-tls"]["mountPath"] == mount
    colocated = pod_of(build(spec_of(**tls)), "p-colocated")["containers"][0]["args"]
    assert "--kv-tls-server-name" not in colocated  # no KV port
    plain = build(spec_of(mode="disaggregated", prefill={}, decode={}))
    assert "--kv-tls-server-name" not in pod_of(plain, "p-decode")["containers"][0]["args"]
