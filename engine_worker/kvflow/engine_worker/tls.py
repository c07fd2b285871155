"""Worker gRPC over TLS, from certificate files (``--tls-cert-file``, ``--tls-key-file``,
``--tls-ca-file``).

With a certificate and key the worker serves gRPC over TLS; with a CA as well it requires
every caller to present a certificate that CA signed (mutual TLS), before any handler or the
token check runs. Files are read once at start: a rotated certificate takes a restart.

With mutual TLS the TCP KV port runs it too, from the same files (``--kv-tls auto``, the
default; kv_transfer/tcp_tls.py): a sender checks the receiver's certificate against the CA
and ``--kv-tls-server-name`` (else the address it dials), a receiver requires the sender's.
``--kv-tls off`` keeps KV plaintext, for a network trusted to carry it, where the TLS cost
on KV throughput matters more (docs/engine.md, "Security and the data plane").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc

from kvflow.engine_worker.kv_transfer.tcp_tls import KvTls

KvTlsMode = Literal["auto", "on", "off"]
KV_TLS_MODES: tuple[KvTlsMode, ...] = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None  # set: callers must present a certificate it signed
    kv_mode: KvTlsMode = "auto"  # auto: the TCP KV port runs TLS when gRPC runs mutual TLS
    kv_server_name: str | None = None  # the name KV receivers' certificates carry

    @property
    def is_kv_on(self) -> bool:
        return self.kv_mode != "off" and self.ca_file is not None

    @property
    def is_on(self) -> bool:
        return self.cert_file is not None

    def problem(self) -> str:
        """What is wrong with the combination of flags, or ""."""
        if (self.cert_file is None) != (self.key_file is None):
            return "--tls-cert-file and --tls-key-file go together: give both or neither"
        if self.ca_file is not None and self.cert_file is None:
            return "--tls-ca-file checks callers' certificates: give --tls-cert-file too"
        if self.kv_mode == "on" and self.ca_file is None:
            return ("--kv-tls on runs mutual TLS on the KV port: give --tls-cert-file, "
                    "--tls-key-file and --tls-ca-file")  # fmt: skip
        if self.kv_server_name is not None and not self.is_kv_on:
            return "--kv-tls-server-name checks KV receivers over TLS: give --tls-ca-file too"
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

    def kv_tls(self) -> KvTls | None:
        """The KV port's TLS, or None when it stays plaintext."""
        if not self.is_kv_on:
            return None
        assert self.cert_file is not None and self.key_file is not None
        assert self.ca_file is not None
        return KvTls.from_files(self.cert_file, self.key_file, self.ca_file, self.kv_server_name)
