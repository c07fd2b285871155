"""A pool applied to the real API server, its pods then run as local processes.

`run_pool` applies a pool manifest, waits for the operator to make it Ready, reads the
pods the controllers created from the operator's Deployments, and starts each one's
container (`pod_processes`): the workers first, then the router, whose `--worker-dns` is
answered from the Service's EndpointSlices (see `worker_list`). The pool's gateway is
then reachable the way a client in the cluster reaches it, through the gateway Service's
endpoint.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from k8s.controlplane import ControlPlane
from k8s.pod_processes import LoopbackNetwork, PodProcess, pod_process
from k8s.pools import wait_ready
from k8s.support import wait_for

# Loading SmolLM2 (GGUF -> float32) takes about 10 s on an idle core; several workers
# loading at once on two shared cores take several times that.
WORKER_READY_S = 300
ROUTER_READY_S = 90


@dataclass
class RunningPool:
    name: str
    namespace: str
    spec: dict[str, Any]
    pods: list[PodProcess]
    gateway_url: str  # http://ADDRESS:PORT of the gateway Service's endpoint

    def grpc_addresses(self, role: str) -> list[str]:
        """host:port of the running workers of one role (what the router names them by)."""
        return sorted(
            f"{p.address}:{p.port('grpc')}"
            for p in self.pods
            if p.pod["metadata"]["labels"]["kvflow.io/role"] == role
        )


def endpoint_pods(cluster: ControlPlane, namespace: str, service: str) -> dict[str, int]:
    """Ready endpoints of a Service as the endpoint-slice controller recorded them:
    pod name -> the port named like the Service's first port."""
    slices = cluster.kubectl_json(
        "get", "endpointslices", "-n", namespace, "-l", f"kubernetes.io/service-name={service}"
    )["items"]  # fmt: skip
    out: dict[str, int] = {}
    for item in slices:
        port = int(item["ports"][0]["port"])
        for endpoint in item.get("endpoints") or []:
            if endpoint.get("conditions", {}).get("ready") and endpoint.get("targetRef"):
                out[endpoint["targetRef"]["name"]] = port
    return out


def worker_list(
    cluster: ControlPlane, network: LoopbackNetwork, dns: str, expected: int
) -> list[str]:
    """What cluster DNS would answer for `--worker-dns NAME.NAMESPACE.svc:PORT`.

    No cluster DNS serves `*.svc` names on this machine, and the router resolves through
    the system resolver, so `--worker-dns` is replaced by the equivalent `--workers` list:
    a headless Service's name resolves to the addresses of its ready endpoints, which are
    read here from the real EndpointSlices and mapped to the processes standing in for
    those pods. The router then finds each worker's role over gRPC, as in a cluster.
    """
    name, port = dns.rsplit(":", 1)
    service, namespace = name.split(".")[:2]
    pods: dict[str, int] = {}

    def listed() -> bool:
        pods.update(endpoint_pods(cluster, namespace, service))
        return len(pods) >= expected

    wait_for(listed, 60, f"{expected} ready endpoints of Service {namespace}/{service}")
    return sorted(f"{network.address(pod)}:{port}" for pod in pods)


def replace_worker_dns(args: list[str], workers: list[str]) -> list[str]:
    at = args.index("--worker-dns")
    return [*args[:at], "--workers", ",".join(workers), *args[at + 2 :]]


def current_pods(cluster: ControlPlane, namespace: str, pool: str) -> list[dict[str, Any]]:
    listed = cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", f"kvflow.io/pool={pool}"
    )["items"]  # fmt: skip
    return [p for p in listed if not p["metadata"].get("deletionTimestamp")]


@contextmanager
def run_pool(
    cluster: ControlPlane,
    namespace: str,
    manifest: Path,
    network: LoopbackNetwork,
    workdir: Path,
    spec_overrides: dict[str, Any] | None = None,
) -> Iterator[RunningPool]:
    """``spec_overrides`` are set on the pool's spec before it is applied: top-level keys,
    merged one level down where both are mappings (``router: {tenantsSecret: ...}`` keeps
    the sample's other router settings)."""
    docs = _yaml_docs(manifest)
    pool = next(d for d in docs if d.get("kind") == "InferencePool")
    name = pool["metadata"]["name"]
    for key, value in (spec_overrides or {}).items():
        current = pool["spec"].get(key)
        both = isinstance(current, dict) and isinstance(value, dict)
        pool["spec"][key] = {**current, **value} if both else value
        manifest = workdir / manifest.name
        manifest.write_text(yaml.safe_dump_all(docs))
    cluster.kubectl("apply", "-n", namespace, "-f", str(manifest))
    ready = wait_ready(cluster, namespace, name)
    num_workers = ready["status"]["desiredReplicas"]
    num_routers = pool["spec"].get("router", {}).get("replicas", 1)
    pods = current_pods(cluster, namespace, name)
    assert len(pods) == num_workers + num_routers, [p["metadata"]["name"] for p in pods]

    def read_configmap(cm: str) -> dict[str, str]:
        data: dict[str, str] = cluster.kubectl_json("get", "configmap", cm, "-n", namespace)["data"]
        return data

    def read_secret(name: str) -> dict[str, str]:
        data = cluster.kubectl_json("get", "secret", name, "-n", namespace)["data"]
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def component(pod: dict[str, Any]) -> str:
        return str(pod["metadata"]["labels"]["app.kubernetes.io/component"])

    running: list[PodProcess] = []
    try:
        workers = [p for p in pods if component(p) == "worker"]
        for pod in workers:
            running.append(
                pod_process(
                    pod,
                    network.address(pod["metadata"]["name"]),
                    workdir,
                    read_configmap,
                    read_secret=read_secret,
                )
            )
            running[-1].start()
        for proc in running:
            proc.wait_ready(WORKER_READY_S)

        routers = [p for p in pods if component(p) == "router"]
        for pod in routers:
            args = pod["spec"]["containers"][0]["args"]
            listed = worker_list(
                cluster, network, args[args.index("--worker-dns") + 1], len(workers)
            )
            proc = pod_process(
                pod,
                network.address(pod["metadata"]["name"]),
                workdir,
                read_configmap,
                rewrite_args=lambda a, listed=listed: replace_worker_dns(a, listed),  # type: ignore[misc]
                read_secret=read_secret,
            )
            running.append(proc)
            proc.start()
            proc.wait_ready(ROUTER_READY_S)

        gateway = endpoint_pods(cluster, namespace, f"{name}-gateway")
        assert gateway, f"the gateway Service of {name} has no ready endpoint"
        router_pod, port = sorted(gateway.items())[0]
        url = f"http://{network.address(router_pod)}:{port}"
        # The router's readiness probe passes with one healthy worker; wait for all of them
        # so that a request has every role to choose from.
        wait_for(
            lambda: _healthy_workers(url) >= len(workers),
            ROUTER_READY_S,
            f"gateway {url} to see {len(workers)} healthy workers",
        )
        yield RunningPool(name, namespace, pool["spec"], running, url)
    finally:
        for proc in reversed(running):
            proc.stop()


def _healthy_workers(url: str) -> int:
    with urllib.request.urlopen(f"{url}/ready", timeout=5) as response:
        return int(json.loads(response.read())["workers_healthy"])


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
