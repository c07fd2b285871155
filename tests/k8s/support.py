"""Processes, certificates and polling for the test control plane (no Kubernetes logic)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (subprocess.SubprocessError, OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(folder: Path) -> None:
    """A throwaway CA, the API server's serving certificate, and the service-account key."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=folder)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvflow-test-ca",
        "-days", "2", "-out", "ca.crt", cwd=folder,
    )  # fmt: skip
    (folder / "san.cnf").write_text(
        "[ext]\nsubjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl("genrsa", "-out", "apiserver.key", "2048", cwd=folder)
    _openssl(
        "req", "-new", "-key", "apiserver.key", "-subj", "/CN=kube-apiserver",
        "-out", "apiserver.csr", cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.cnf", "-extensions", "ext",
        "-out", "apiserver.crt", cwd=folder,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "test", "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config))
    return path


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, num_chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def stop(self, grace_s: float = 10) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(grace_s)


def start(
    name: str, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None
) -> Process:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env,
            start_new_session=True,  # a Ctrl-C in pytest reaches pytest, which stops us
        )  # fmt: skip
    return Process(name, popen, log)


def which_openssl() -> str:
    found = shutil.which("openssl")
    assert found, (
        "openssl is needed to make the test cluster's certificates (apt-get install openssl)"
    )
    return found
