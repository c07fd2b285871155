"""Certificates for TLS tests, made by the real openssl: a CA, a server certificate for
127.0.0.1, localhost and a Service-like name, a client certificate the CA signed, and a
self-signed "rogue" one."""

from __future__ import annotations

import subprocess
from pathlib import Path

SERVICE_NAME = "pool-workers.ns.svc"  # what a cert-manager Certificate for a pool would name


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path, service_name: str = SERVICE_NAME) -> None:
    """ca.pem; server.pem (IP 127.0.0.1, localhost, ``service_name``) and client.pem signed
    by it; rogue.pem self-signed."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "1", "-subj", "/CN=kvflow-test-ca", cwd=d)  # fmt: skip
    (d / "server.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{service_name}\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", *ext, cwd=d)  # fmt: skip
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "rogue.key", "-out",
            "rogue.pem", "-days", "1", "-subj", "/CN=client", cwd=d)  # fmt: skip
