"""The SLO planner inside the real operator, against the real API server.

Worker pods are scheduled onto a KWOK node of their own whose pod CIDR is a loopback /24,
so every pod IP the API server holds is an address of this machine. Each worker pod's
container is started as a local `kvflow worker --simulate` process bound to that IP
(`pod_processes`), and the operator reads their /metrics exactly as it would in a cluster:
by pod IP. The test drives load with gRPC Generate calls straight to the workers; the
simulated step time grows with the batch (5 ms + 2 ms per token), so 24 concurrent
streams put TPOT near 50 ms, over the 30 ms target, and an idle worker is far below it.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from k8s.controlplane import ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pod_processes import PodProcess, pod_process
from k8s.pools import apply_pool, condition, get_pool, pool_events, replica_owners, wait_ready
from k8s.served_pools import current_pods
from k8s.support import wait_for

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

TAINT = {"key": "kvflow.io/test", "value": "planner", "effect": "NoSchedule"}
# Several planner intervals of 5 s, on two shared cores.
DECIDE_S = 90


@pytest.fixture()
def loopback_node(cluster: ControlPlane) -> Iterator[str]:
    """A fake node whose pods get loopback IPs (KWOK allocates from the node's podCIDR)."""
    prefix = f"127.{random.randint(16, 254)}.{random.randint(0, 254)}"
    name = f"kwok-planner-{prefix.replace('.', '-')}"
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"kubernetes.io/hostname": name, "type": "kwok", "kvflow.io/test": name},
        },
        "spec": {"podCIDR": f"{prefix}.0/24", "taints": [TAINT]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))

    def ready() -> bool:
        got = cluster.kubectl_json("get", "node", name)
        conditions = got.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    wait_for(ready, 60, f"node {name} Ready")
    yield name
    cluster.kubectl("delete", "node", name, "--wait=false", check=False)


def pinned(node: str) -> dict[str, Any]:
    return {"nodeSelector": {"kvflow.io/test": node}, "tolerations": [TAINT]}


def planner_spec(node: str, **colocated: Any) -> dict[str, Any]:
    return {
        "model": {"servedName": "sim"},
        "engine": {
            "simulate": True,
            "extraArgs": ["--sim-base-step-ms", "5", "--sim-per-token-ms", "2"],
        },
        "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3, **pinned(node),
                      **colocated},
        "router": pinned(node),
        "slo": {"ttftTargetMs": 5000, "tpotTargetMs": 30, "percentile": 90},
        "autoscaling": {
            "enabled": True,
            "intervalSeconds": 5,
            "scaleDownStabilizationSeconds": 10,
            "scaleUpCooldownSeconds": 5,
            "replicaStartupSeconds": 5,
        },
    }  # fmt: skip


def deployment_replicas(cluster: ControlPlane, namespace: str, name: str) -> int:
    got = cluster.kubectl_json("get", "deployment", name, "-n", namespace)
    return int(got["spec"].get("replicas", 0))


def read_secret(cluster: ControlPlane, namespace: str, name: str) -> dict[str, str]:
    data = cluster.kubectl_json("get", "secret", name, "-n", namespace)["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def start_workers(
    cluster: ControlPlane, namespace: str, pool: str, workdir: Path, running: dict[str, PodProcess]
) -> None:
    """A process for every ready worker pod that has none yet, bound to the pod's own IP."""
    for pod in current_pods(cluster, namespace, pool):
        name = pod["metadata"]["name"]
        ip = pod.get("status", {}).get("podIP", "")
        is_worker = pod["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
        if not is_worker or name in running or not ip.startswith("127."):
            continue
        proc = pod_process(
            pod,
            ip,
            workdir,
            lambda cm: {},
            read_secret=lambda s: read_secret(cluster, namespace, s),
        )
        running[name] = proc
        proc.start()
        proc.wait_ready(120)


class Load:
    """`streams` concurrent Generate calls to one worker, each 40 tokens, until stopped."""

    def __init__(self, address: str, streams: int, token: str) -> None:
        self.address, self.streams = address, streams
        # The pool's worker token (the Secret the operator generated): workers refuse
        # calls without it.
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.stop_flag = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(60)

    def _run(self, index: int) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            n = 0
            while not self.stop_flag.is_set():
                n += 1
                request = pb.GenerateRequest(
                    request_id=f"load-{index}-{n}",
                    prompt_token_ids=[(index * 131 + n * 7 + i) % 30000 + 10 for i in range(48)],
                    sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0),
                )
                try:
                    for _ in stub.Generate(request, timeout=60, metadata=self.metadata):
                        pass
                    self.completed += 1
                except grpc.RpcError as exc:
                    self.errors.append(str(exc.code()))
                    time.sleep(0.5)


def test_planner_scales_a_role_up_under_load_and_down_when_idle(
    cluster: ControlPlane,
    namespace: str,
    operator: OperatorProcess,
    loopback_node: str,
    tmp_path: Path,
) -> None:
    apply_pool(cluster, namespace, "plan", planner_spec(loopback_node))
    wait_ready(cluster, namespace, "plan")
    running: dict[str, PodProcess] = {}
    try:
        start_workers(cluster, namespace, "plan", tmp_path, running)
        (first,) = running.values()
        assert deployment_replicas(cluster, namespace, "plan-colocated") == 1

        token = read_secret(cluster, namespace, "plan-worker-token")["token"]
        with Load(f"{first.address}:50051", streams=24, token=token) as load:

            def scaled_up() -> bool:
                return deployment_replicas(cluster, namespace, "plan-colocated") >= 2

            wait_for(scaled_up, DECIDE_S, "the planner to add a colocated replica under load")
            assert load.completed > 0, load.errors
        pool = get_pool(cluster, namespace, "plan")
        planner = pool["status"]["planner"]
        assert planner["lastDecision"].startswith("colocated 1->"), planner
        assert "TpotViolation" in planner["reason"], planner
        assert {r["name"]: r["replicas"] for r in planner["roles"]}["colocated"] >= 2
        slo = condition(pool, "SLOMet")
        assert (slo["status"], slo["reason"]) == ("False", "TpotAboveTarget"), slo
        scaled = [
            m for reason, m in pool_events(cluster, namespace, "plan") if reason == "ScaledUp"
        ]
        assert scaled and scaled[0].startswith("colocated 1 -> "), scaled
        # Every input and the decision are exported by the operator.
        metrics = operator_metrics(operator)
        assert (
            f'kvflow_operator_planner_replicas{{namespace="{namespace}",pool="plan",role="colocated"}}'
            in metrics
        )
        assert 'input="tpot_violation_fraction"' in metrics
        assert 'reason="TpotViolation"' in metrics

        # The decision survives drift sweeps (every 3 s): reconcile applies the planner's
        # replicas, not the spec's 1.
        start_workers(cluster, namespace, "plan", tmp_path, running)
        # Idle now: after the stabilization window the planner gives the replica back.
        wait_for(
            lambda: deployment_replicas(cluster, namespace, "plan-colocated") == 1,
            DECIDE_S,
            "the planner to scale back down when idle",
        )
        # The Event follows the Deployment's new replicas (planning.py applies, then posts):
        # on a busy machine it can trail the replica count by a moment.
        wait_for(
            lambda: "ScaledDown" in [r for r, _ in pool_events(cluster, namespace, "plan")],
            30,
            "the ScaledDown Event after the Deployment went to 1",
        )
        assert "Underloaded" in get_pool(cluster, namespace, "plan")["status"]["planner"]["reason"]
    finally:
        for proc in running.values():
            proc.stop()
        operator.assert_alive()


def operator_metrics(operator: OperatorProcess) -> str:
    import urllib.request

    url = f"http://127.0.0.1:{operator.liveness_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def test_a_role_handed_to_an_external_autoscaler_keeps_its_replicas(
    cluster: ControlPlane, namespace: str, operator: OperatorProcess, loopback_node: str
) -> None:
    # Operator-scaled first (3 replicas), then handed over: the count must stay 3, not
    # fall to a Deployment's default of 1 when the operator stops applying it.
    spec = planner_spec(loopback_node, replicas=3)
    apply_pool(cluster, namespace, "ext", spec)
    wait_ready(cluster, namespace, "ext")
    spec["colocated"]["externalAutoscaler"] = True
    apply_pool(cluster, namespace, "ext", spec)
    wait_ready(cluster, namespace, "ext")
    assert deployment_replicas(cluster, namespace, "ext-colocated") == 3

    # What an HPA does: write the scale subresource.
    cluster.kubectl("scale", "deployment", "ext-colocated", "-n", namespace, "--replicas", "2")
    time.sleep(12)  # four drift sweeps and two planner intervals
    replicas, owners = replica_owners(cluster, namespace, "ext-colocated")
    assert replicas == 2, owners
    assert "kvflow-operator" not in owners, owners
    wait_for(
        lambda: get_pool(cluster, namespace, "ext")["status"]["desiredReplicas"] == 2,
        30,
        "status to report the external autoscaler's count",
    )
    # The planner does not decide for a role it does not own.
    assert get_pool(cluster, namespace, "ext")["status"]["planner"]["roles"] == []
