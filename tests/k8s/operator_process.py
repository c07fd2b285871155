"""A real `kvflow operator` subprocess pointed at the test API server."""

from __future__ import annotations

import os
import re
import signal
import sys
import urllib.request
from pathlib import Path

from k8s.controlplane import SYSTEM_NAMESPACE, ControlPlane
from k8s.support import Process, start, wait_for
from testkit.ports import free_port

WORKER_IMAGE = "registry.invalid/kvflow-worker:test"  # never pulled: KWOK runs no containers
ROUTER_IMAGE = "registry.invalid/kvflow-router:test"
# Short enough that a test sees drift repaired within seconds, long enough not to swamp
# two shared cores with reconciles.
DRIFT_INTERVAL_S = 3


def kvflow_command() -> list[str]:
    script = Path(sys.executable).with_name("kvflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvflow.cli.main"]


class OperatorProcess:
    def __init__(
        self,
        cluster: ControlPlane,
        kubeconfig: Path,
        workdir: Path,
        identity: str,
        lease_name: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.cluster, self.kubeconfig, self.workdir = cluster, kubeconfig, workdir
        self.identity = identity
        unique = re.sub(r"[^a-z0-9]+", "-", workdir.name.lower()).strip("-")
        self.lease_name = lease_name or f"kvflow-operator-{unique}"[:63].rstrip("-")
        self.extra_args = extra_args
        self.proc: Process | None = None
        self.starts = 0
        self.liveness_port = 0

    def start(self, wait_leading: bool = True) -> None:
        self.starts += 1
        self.liveness_port = free_port()
        argv = [
            *kvflow_command(), "operator",
            "--kubeconfig", str(self.kubeconfig),
            "--lease-namespace", SYSTEM_NAMESPACE,
            "--lease-name", self.lease_name,
            "--identity", self.identity,
            "--drift-interval-seconds", str(DRIFT_INTERVAL_S),
            "--liveness-port", str(self.liveness_port),
            "--worker-image", WORKER_IMAGE,
            "--router-image", ROUTER_IMAGE,
            *self.extra_args,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        self.proc = start(f"operator-{self.identity}-{self.starts}", argv, self.workdir, env)
        if wait_leading:
            try:
                self.wait_leading()
            except BaseException:
                self.stop()  # never leak a process when the fixture fails before yielding
                raise

    def healthz(self) -> str:
        """The body of GET /healthz ("leading" or "waiting for lease")."""
        url = f"http://127.0.0.1:{self.liveness_port}/healthz"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            return str(response.read().decode()).strip()

    def log(self) -> str:
        return self.proc.tail(200_000) if self.proc else ""

    def wait_leading(self, timeout_s: float = 90) -> None:
        def leading() -> bool:
            assert self.proc is not None
            assert self.proc.popen.poll() is None, f"operator exited:\n{self.proc.tail()}"
            # Leading, and kopf logged in: its watches (not only the drift sweep) run.
            log = self.log()
            return "leading as" in log and "login' succeeded" in log

        wait_for(leading, timeout_s, f"operator {self.identity} to lead")

    def stop(self) -> int | None:
        """SIGTERM (a clean stop that releases the Lease); the exit status."""
        if self.proc is None:
            return None
        self.proc.stop(grace_s=20)
        return self.proc.popen.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, nothing released."""
        if self.proc is not None and self.proc.popen.poll() is None:
            self.proc.popen.send_signal(signal.SIGKILL)
            self.proc.popen.wait(10)

    def assert_alive(self) -> None:
        assert self.proc is not None and self.proc.popen.poll() is None, self.log()[-3000:]
