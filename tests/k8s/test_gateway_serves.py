"""An InferenceGateway the operator rendered actually serves both pools behind it.

Two pools of simulated workers, one gateway, one model split 90/10; smol-v1's workers speak
gRPC over mutual TLS only (spec.workerTls), smol-v2's plaintext. Once the operator has
made them Ready (a TLS pool no longer degrades a gateway), the pods the controllers
created run as local processes (`pod_processes`), and requests go through the gateway
Service's endpoint with the official `openai` client. No cluster DNS answers `*.svc`
here, so each `pools[].worker_dns` of the gateway's router.yaml is replaced by the
`workers` list DNS would answer (the Service's ready EndpointSlices, mapped to the
processes), as `served_pools` does for a pool's `--worker-dns` flag, and each
`pools[].worker_tls` file path by the folder that stands in for the gateway pod's mount
of the pool's Secret.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from k8s.controlplane import ControlPlane
from k8s.gateways import (
    SHARED_TOKEN,
    apply,
    condition,
    model_spec,
    pool_spec,
    resolved,
    wait_gateway,
)
from k8s.operator_process import OperatorProcess
from k8s.pod_processes import LoopbackNetwork, PodProcess, localize, pod_process, volume_folder
from k8s.pools import wait_ready
from k8s.served_pools import ROUTER_READY_S, current_pods, endpoint_pods, worker_list
from k8s.support import wait_for
from testkit.certs import make_certs

pytestmark = pytest.mark.slow

POOLS = {"smol-v1": "smollm2-v1", "smol-v2": "smollm2-v2"}
TLS_POOL = "smol-v1"  # its workers require a client certificate; smol-v2's speak plaintext
WORKER_READY_S = 120  # simulated workers load no model


def gateway_pods(cluster: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    listed = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", "kvflow.io/gateway=front")
    return [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]


def pools_healthy(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
        body = json.loads(response.read())
    return {name: int(p["workers_healthy"]) for name, p in body.get("pools", {}).items()}


def test_gateway_serves_both_pools_through_its_service(
    cluster: ControlPlane, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl(
        "create", "secret", "generic", SHARED_TOKEN["name"], "-n", namespace,
        f"--from-literal={SHARED_TOKEN['key']}=shared-token-of-both-pools",
    )  # fmt: skip
    # What a cert-manager Certificate for the TLS pool's workers would hold.
    certs = tmp_path / "tls"
    certs.mkdir()
    make_certs(certs, f"{TLS_POOL}-workers.{namespace}.svc")
    cluster.kubectl("create", "secret", "generic", f"{TLS_POOL}-tls", "-n", namespace,
                    f"--from-file=tls.crt={certs / 'server.pem'}",
                    f"--from-file=tls.key={certs / 'server.key'}",
                    f"--from-file=ca.crt={certs / 'ca.pem'}")  # fmt: skip
    for name, served in POOLS.items():
        tls = {"workerTls": {"secretName": f"{name}-tls"}} if name == TLS_POOL else {}
        apply(cluster, "InferencePool", namespace, name, {**pool_spec(served), **tls})
    apply(cluster, "InferenceGateway", namespace, "front", {})
    apply(cluster, "InferenceModel", namespace, "smollm2", model_spec("front", **{
        "smol-v1": 90, "smol-v2": 10}))  # fmt: skip
    for name in POOLS:
        wait_ready(cluster, namespace, name)
    gateway = wait_gateway(cluster, namespace, "front", "Ready", resolved(90, 10))
    assert condition(gateway, "Degraded")["status"] == "False"  # the TLS pool included

    network = LoopbackNetwork()

    def read_configmap(name: str) -> dict[str, str]:
        data: dict[str, str] = cluster.kubectl_json("get", "configmap", name, "-n", namespace)[
            "data"
        ]
        return data

    def read_secret(name: str) -> dict[str, str]:
        data = cluster.kubectl_json("get", "secret", name, "-n", namespace)["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    (router_pod,) = gateway_pods(cluster, namespace)
    mounts = {  # the gateway pod's mount paths -> the folders pod_process fills for them
        m["mountPath"]: volume_folder(tmp_path, router_pod, m["name"])
        for m in router_pod["spec"]["containers"][0]["volumeMounts"]
    }

    def gateway_config(name: str) -> Mapping[str, str]:
        """The gateway's ConfigMap with each pool's DNS name answered as DNS would, and
        its TLS files where the pod's mounts of the pools' Secrets are here."""
        data = read_configmap(name)
        config = yaml.safe_load(data["router.yaml"])
        for pool in config["pools"]:
            pool["workers"] = worker_list(cluster, network, pool.pop("worker_dns"), 1)
            for key, path in pool.get("worker_tls", {}).items():
                pool["worker_tls"][key] = localize(path, mounts, "")
        assert [p["name"] for p in config["pools"] if "worker_tls" in p] == [TLS_POOL]
        return {**data, "router.yaml": yaml.safe_dump(config)}

    running: list[PodProcess] = []
    try:
        for name in POOLS:
            for pod in current_pods(cluster, namespace, name):
                if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
                    address = network.address(pod["metadata"]["name"])
                    running.append(
                        pod_process(pod, address, tmp_path, read_configmap, read_secret=read_secret)
                    )
                    running[-1].start()
        for proc in running:
            proc.wait_ready(WORKER_READY_S)
        router = pod_process(
            router_pod,
            network.address(router_pod["metadata"]["name"]),
            tmp_path,
            gateway_config,
            read_secret=read_secret,
        )
        running.append(router)
        router.start()
        router.wait_ready(ROUTER_READY_S)

        endpoints = endpoint_pods(cluster, namespace, "front")  # the gateway Service
        assert list(endpoints) == [router_pod["metadata"]["name"]]
        url = f"http://{router.address}:{endpoints[router_pod['metadata']['name']]}"
        wait_for(
            lambda: pools_healthy(url) == {"smol-v1": 1, "smol-v2": 1},
            ROUTER_READY_S,
            "the gateway to see a healthy worker in each pool",
        )
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        listed = {m.id for m in client.models.list().data}
        assert listed == {"smollm2", "chat", "smollm2-v1", "smollm2-v2"}
        # A pool's served name pins that version; the answer names the pool that served it.
        for served in POOLS.values():
            chat = client.chat.completions.create(
                model=served, messages=[{"role": "user", "content": "hello"}], max_tokens=4
            )
            assert chat.model == served
            assert chat.choices[0].message.content
        # The public name and its alias reach one of the model's versions.
        for name in ("smollm2", "chat"):
            completion = client.completions.create(model=name, prompt="hello", max_tokens=4)
            assert completion.model in POOLS.values()
    finally:
        for proc in reversed(running):
            proc.stop()
