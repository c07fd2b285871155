"""A real Kubernetes control plane on loopback for the integration tests.

etcd, kube-apiserver, kube-controller-manager (Deployments get ReplicaSets and Pods, owner
references are garbage-collected), kube-scheduler and KWOK (fake nodes that turn Pods
Running and Ready), all built from their Go modules by tools/k8s/build.sh. kubectl and
helm are the real binaries from tools/k8s/fetch_clients.sh. Nothing here is faked: only
the Pods' containers never run (KWOK nodes have no kubelet).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s.support import Process, make_pki, start, wait_for, write_kubeconfig
from testkit.ports import free_port

REPO = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO / "tools" / "k8s" / "versions.env"
CHART = REPO / "helm" / "kvflow"
RELEASE = "kvflow"
SYSTEM_NAMESPACE = "kvflow-system"  # where the chart (and the operator's Lease) lives
ADMIN_TOKEN = "kvflow-test-admin-token"  # loopback-only cluster, discarded after the session


def read_versions() -> dict[str, str]:
    out = {}
    for raw in VERSIONS_FILE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value
    return out


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvflow" / "k8s"
    return Path(os.environ.get("KVFLOW_K8S_CACHE", default))


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    apiserver: Path
    controller_manager: Path
    scheduler: Path
    kwok: Path
    kwok_stages: Path
    kubectl: Path
    helm: Path

    @staticmethod
    def locate() -> Binaries:
        """The cached binaries; AssertionError (a failing test, not a skip) when absent."""
        v, cache = read_versions(), cache_dir()
        k8s = cache / f"kubernetes-{v['K8S_VERSION']}" / "bin"
        clients = cache / f"clients-{v['CLIENTS_WHEEL'].replace('==', '-')}" / "bin"
        kwok = cache / f"kwok-{v['KWOK_VERSION']}"
        found = Binaries(
            etcd=cache / f"etcd-{v['ETCD_VERSION']}" / "bin" / "etcd",
            apiserver=k8s / "kube-apiserver",
            controller_manager=k8s / "kube-controller-manager",
            scheduler=k8s / "kube-scheduler",
            kwok=kwok / "bin" / "kwok",
            kwok_stages=kwok / "stages",
            kubectl=clients / "kubectl",
            helm=clients / "helm",
        )
        missing = [str(p) for p in vars(found).values() if not p.exists()]
        assert not missing, (
            f"Kubernetes test binaries missing: {missing}. Build them with "
            "tools/k8s/build.sh and tools/k8s/fetch_clients.sh (.ci/run does both)."
        )
        return found


@dataclass
class ControlPlane:
    bins: Binaries
    workdir: Path
    server: str = ""
    kubeconfig: Path = Path()
    processes: list[Process] = field(default_factory=list)

    def _start(self, name: str, argv: Sequence[str]) -> Process:
        proc = start(name, argv, self.workdir)
        self.processes.append(proc)
        return proc

    def _alive(self, proc: Process) -> None:
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.tail()}"

    def up(self, timeout_s: float = 180) -> None:
        pki = self.workdir / "pki"
        make_pki(pki)
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        etcd = self._start(
            "etcd",
            [
                str(self.bins.etcd),
                "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",  # a test cluster: durability does not matter, speed does
                "--log-level", "warn",
            ],
        )  # fmt: skip
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{ADMIN_TOKEN},kvflow-admin,kvflow-admin,"system:masters"\n')
        api = self._start(
            "kube-apiserver",
            [
                str(self.bins.apiserver),
                "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
                "--bind-address", "127.0.0.1",
                "--advertise-address", "127.0.0.1",
                "--secure-port", str(api_port),
                "--cert-dir", str(self.workdir / "apiserver-certs"),
                "--tls-cert-file", str(pki / "apiserver.crt"),
                "--tls-private-key-file", str(pki / "apiserver.key"),
                "--client-ca-file", str(pki / "ca.crt"),
                "--token-auth-file", str(tokens),
                "--authorization-mode", "RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file", str(pki / "sa.pub"),
                "--service-account-signing-key-file", str(pki / "sa.key"),
                "--service-cluster-ip-range", "10.96.0.0/16",
                "--allow-privileged",
                "--v", "1",
            ],
        )  # fmt: skip
        self.server = f"https://127.0.0.1:{api_port}"
        self.kubeconfig = write_kubeconfig(
            self.workdir / "admin.kubeconfig", self.server, pki / "ca.crt", ADMIN_TOKEN, "admin"
        )

        def api_ready() -> bool:
            self._alive(etcd)
            self._alive(api)
            out = self.kubectl("get", "--raw", "/readyz", check=False)
            return out.returncode == 0 and out.stdout.strip() == "ok"

        wait_for(api_ready, timeout_s, "kube-apiserver /readyz", interval_s=1)

        kcm = self._start(
            "kube-controller-manager",
            [
                str(self.bins.controller_manager),
                "--kubeconfig", str(self.kubeconfig),
                "--controllers", "*",
                "--service-account-private-key-file", str(pki / "sa.key"),
                "--root-ca-file", str(pki / "ca.crt"),
                "--leader-elect=false",
                "--secure-port", "0",
                # Pods on KWOK nodes never report to a kubelet; keep nodes from being
                # evicted for silence while KWOK renews their leases.
                "--node-monitor-grace-period", "120s",
                "--v", "1",
            ],
        )  # fmt: skip
        sched = self._start(
            "kube-scheduler",
            [
                str(self.bins.scheduler),
                "--kubeconfig", str(self.kubeconfig),
                "--leader-elect=false",
                "--secure-port", "0",
                "--v", "1",
            ],
        )  # fmt: skip
        stages = self.workdir / "kwok-stages.yaml"
        stages.write_text(
            "\n---\n".join(p.read_text() for p in sorted(self.bins.kwok_stages.glob("*.yaml")))
        )
        kwok = self._start(
            "kwok",
            [
                str(self.bins.kwok),
                "--kubeconfig", str(self.kubeconfig),
                "--config", str(stages),
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
                "--node-lease-duration-seconds", "40",
                "--server-address", f"127.0.0.1:{free_port()}",
            ],
        )  # fmt: skip
        for node in FAKE_NODES:
            self.kubectl("apply", "-f", "-", input=json.dumps(node))

        def nodes_ready() -> bool:
            for proc in (kcm, sched, kwok):
                self._alive(proc)
            out = self.kubectl("get", "nodes", "-o", "json")
            nodes = json.loads(out.stdout)["items"]
            ready = [
                n for n in nodes
                if any(c["type"] == "Ready" and c["status"] == "True"
                       for c in n.get("status", {}).get("conditions", []))
            ]  # fmt: skip
            return len(ready) == len(FAKE_NODES)

        wait_for(nodes_ready, timeout_s, "KWOK nodes Ready", interval_s=1)

        def service_accounts_ready() -> bool:  # the controller-manager is doing its work
            out = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
            return out.returncode == 0

        wait_for(service_accounts_ready, timeout_s, "the default ServiceAccount", interval_s=1)

    def down(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail(1500)}" for p in self.processes)

    # --- clients -------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout_s: float = 60,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bins.kubectl), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        out = subprocess.run(
            argv, check=False, input=input, capture_output=True, text=True, timeout=timeout_s
        )
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{out.stderr}")
        return out

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(
        self, *args: str, check: bool = True, timeout_s: float = 180
    ) -> subprocess.CompletedProcess[str]:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        out = subprocess.run(
            [str(self.bins.helm), *args], check=False, capture_output=True, text=True, env=env,
            timeout=timeout_s,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
        return out


def _fake_node(name: str, gpus: int) -> dict[str, Any]:
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **({"nvidia.com/gpu.present": "true"} if gpus else {}),
            },
        },
        "status": {"capacity": capacity, "allocatable": capacity},
    }


# Two CPU nodes (topology spread has somewhere to spread) and one with 8 GPUs.
FAKE_NODES = [_fake_node("kwok-cpu-0", 0), _fake_node("kwok-cpu-1", 0), _fake_node("kwok-gpu-0", 8)]
