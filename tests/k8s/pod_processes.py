"""Run the containers of pods the operator created as local processes.

KWOK turns pods Running and Ready without running anything, so a pool whose workers could
never serve still looks Ready to the API server. These helpers stand in for a kubelet and
a container runtime for kvflow's own images: each pod becomes one process started from its
container's command, args and env exactly as the API server returns them, with only what
a pod sandbox would provide filled in:

- network: each pod gets a loopback address of its own (Linux routes all of 127.0.0.0/8 to
  `lo`), used as its pod IP (`status.podIP` in the downward API). A pod has its own network
  namespace, where 0.0.0.0 means "this pod's addresses"; the processes here share one, so
  0.0.0.0 in args becomes the pod's address, and the fixed container ports of several pods
  (50051, 9400, 8000) do not collide.
- volumes: emptyDir, configMap and secret volumes become folders (a configMap's or a
  Secret's keys written from the API server's copy, at their `items` paths when the volume
  lists some, as the kubelet does); paths under a mount in args and env are rewritten to
  the folder.
- `$(VAR)` in command and args is expanded from the container's env, as the kubelet does.
- readiness: the container's own readinessProbe (httpGet) is polled.

Anything else a pod spec might need (PVCs, host paths, a secret volume without a way to
read Secrets) fails loudly.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s.support import Process, start

ANY_ADDRESS = "0.0.0.0"
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, `$$` escapes a `$`,
    and references to undefined variables are left as written."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR.sub(replace, text)


class LoopbackNetwork:
    """One 127.A.B.x address per pod. A and B are drawn per network, so two test sessions
    on one machine (several engineers share it) do not bind the same address and port."""

    def __init__(self) -> None:
        self._prefix = f"127.{random.randint(16, 254)}.{random.randint(0, 254)}"
        self._addresses: dict[str, str] = {}

    def address(self, pod_name: str) -> str:
        if pod_name not in self._addresses:
            assert len(self._addresses) < 250, "one loopback /24 per network"
            self._addresses[pod_name] = f"{self._prefix}.{len(self._addresses) + 2}"
        return self._addresses[pod_name]


@dataclass
class PodProcess:
    """The one container of a pod, running as a local process."""

    pod: dict[str, Any]
    address: str
    argv: list[str]
    env: dict[str, str]
    workdir: Path
    process: Process | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["spec"]["containers"]
        return dict(container)

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        ports = {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}
        return int(ports[name_or_number])

    def start(self) -> None:
        self.process = start(self.name, self.argv, self.workdir, self.env)

    def log(self) -> str:
        return self.process.tail(6000) if self.process else ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until the container's readinessProbe (httpGet) answers 200."""
        probe = self.container["readinessProbe"]["httpGet"]
        url = f"http://{self.address}:{self.port(probe['port'])}{probe['path']}"
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            assert self.process is not None
            code = self.process.popen.poll()
            assert code is None, f"pod {self.name} exited with {code}:\n{self.log()}"
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = repr(exc)
            time.sleep(0.5)
        raise AssertionError(f"pod {self.name} not ready at {url} ({last}):\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace_s=15)


def container_env(
    container: Mapping[str, Any],
    pod: Mapping[str, Any],
    address: str,
    read_secret: Callable[[str], Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """The container's env as the kubelet sets it (values may refer to earlier entries)."""
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "status.podIP": address,
        "spec.nodeName": pod["spec"].get("nodeName", ""),
    }
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in entry.get("valueFrom", {}) and read_secret is not None:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = read_secret(ref["name"])[ref["key"]]
        else:
            raise AssertionError(f"env {entry} of pod {pod['metadata']['name']}: unsupported here")
    return env


VOLUMES = "volumes"  # in a pod's folder, a folder per volume it mounts


def volume_folder(workdir: Path, pod: Mapping[str, Any], volume: str) -> Path:
    """Where `pod_process(pod, ..., workdir, ...)` puts what its volume `volume` holds."""
    return workdir / pod["metadata"]["name"] / VOLUMES / volume


def mount_folders(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    folder: Path,
    read_configmap: Callable[[str], Mapping[str, str]],
    read_secret: Callable[[str], Mapping[str, str]] | None = None,
) -> dict[str, Path]:
    """Container mount path -> a local folder holding what the volume would."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = folder / VOLUMES / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            for key, text in read_configmap(volume["configMap"]["name"]).items():
                (local / key).write_text(text)
        elif "secret" in volume and read_secret is not None:
            data = read_secret(volume["secret"]["secretName"])
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (local / item["path"]).write_text(data[item["key"]])
        elif "emptyDir" not in volume:
            raise AssertionError(f"volume {volume} of pod {pod['metadata']['name']}: unsupported")
        mounts[mount["mountPath"]] = local
    return mounts


def localize(text: str, mounts: Mapping[str, Path], address: str) -> str:
    """A value as the process must see it: the pod's address for 0.0.0.0, local folders
    for paths under the container's mounts (the longest mount path wins)."""
    if text == ANY_ADDRESS:
        return address
    for path in sorted(mounts, key=len, reverse=True):
        if text == path or text.startswith(path.rstrip("/") + "/"):
            return str(mounts[path]) + text[len(path.rstrip("/")) :]
    return text


def executable(name: str) -> str:
    """Where the image's PATH would find `name`: kvflow is this interpreter's entry point."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    assert found, f"{name} is not installed next to {sys.executable} or on PATH"
    return found


def base_env() -> dict[str, str]:
    """What the image's own environment would hold (PATH, locale), not this test's config."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVFLOW_") and k not in ("KUBECONFIG", "HOME", "XDG_CACHE_HOME")
    }


def pod_process(
    pod: dict[str, Any],
    address: str,
    workdir: Path,
    read_configmap: Callable[[str], Mapping[str, str]],
    rewrite_args: Callable[[list[str]], list[str]] = lambda args: args,
    read_secret: Callable[[str], Mapping[str, str]] | None = None,
) -> PodProcess:
    """The process that stands in for `pod` (not started). `rewrite_args` replaces what only
    a cluster provides (say, a Service's DNS name) and must say why where it is defined."""
    (container,) = pod["spec"]["containers"]
    folder = workdir / pod["metadata"]["name"]
    folder.mkdir(parents=True, exist_ok=True)
    mounts = mount_folders(pod, container, folder, read_configmap, read_secret)
    env = {
        k: localize(v, mounts, address)
        for k, v in container_env(container, pod, address, read_secret).items()
    }
    words = [*container.get("command", []), *container.get("args", [])]
    words = [localize(expand(w, env), mounts, address) for w in words]
    argv = [executable(words[0]), *rewrite_args(words[1:])]
    full_env = {**base_env(), **env, "PYTHONUNBUFFERED": "1"}
    return PodProcess(pod=pod, address=address, argv=argv, env=full_env, workdir=folder)
