"""Worker gRPC over TLS, from certificate files (``--tls-cert-file``, ``--tls-key-file``,
``--tls-ca-file``).

With a certificate and key the worker serves gRPC over TLS; with a CA as well it requires
every caller to present a certificate that CA signed (mutual TLS), before any handler or the
token check runs. Files are read once at start: a rotated certificate takes a restart. The
KV port is not covered (its in-place vectored I/O bypasses a TLS layer; the worker token
proves both ends and the payload there, docs/engine.md, "Security and the data plane").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None  # set: callers must present a certificate it signed

    @property
    def is_on(self) -> bool:
        return self.cert_file is not None

    def problem(self) -> str:
        """What is wrong with the combination of flags, or ""."""
        if (self.cert_file is None) != (self.key_file is None):
            return "--tls-cert-file and --tls-key-file go together: give both or neither"
        if self.ca_file is not None and self.cert_file is None:
            return "--tls-ca-file checks callers' certificates: give --tls-cert-file too"
        for flag, path in (("--tls-cert-file", self.cert_file), ("--tls-key-file", self.key_file),
                           ("--tls-ca-file", self.ca_file)):  # fmt: skip
            if path is not None and not Path(path).is_file():
                return f"{flag} {path}: no such file"
        return ""

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.cert_file is not None and self.key_file is not None
        pair = (Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes())
        ca = Path(self.ca_file).read_bytes() if self.ca_file is not None else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=ca is not None
        )
