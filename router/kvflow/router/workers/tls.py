"""The gateway's side of worker gRPC over (mutual) TLS: the CA that signed the workers'
certificates, and the gateway's own certificate and key when the workers require one
(`kvflow worker --tls-ca-file`). Files are read once at start, as the worker reads its own.
The --worker-tls-* flags set it for the router's workers; a gateway's `pools:` entry may
set its own (models/pools.py), so one gateway fronts TLS and plaintext pools together.

Workers are dialled by address (a headless Service's A records are pod IPs), so a
certificate issued for a name (cert-manager's `<pool>-workers.<namespace>.svc`) is checked
against ``server_name`` instead of the address.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsFieldNames:
    """How an error message names each setting: a flag, or a config file's field."""

    ca_file: str
    cert_file: str
    key_file: str


FLAG_NAMES = TlsFieldNames(
    "--worker-tls-ca-file", "--worker-tls-cert-file", "--worker-tls-key-file"
)


@dataclass(frozen=True, slots=True)
class WorkerTls:
    ca_file: str | None = None  # set: dial workers over TLS, trusting this CA
    cert_file: str | None = None  # with key_file: present this certificate (mutual TLS)
    key_file: str | None = None
    server_name: str | None = None  # the name workers' certificates carry; None: the address

    @property
    def is_on(self) -> bool:
        return self.ca_file is not None

    def problem(self, names: TlsFieldNames | None = None) -> str:
        """What is wrong with the combination of settings, or ""; ``names``: how they are
        spelled where they came from (default: the --worker-tls-* flags)."""
        n = FLAG_NAMES if names is None else names
        if (self.cert_file is None) != (self.key_file is None):
            return f"{n.cert_file} and {n.key_file} go together: give both"
        if not self.is_on and (self.cert_file is not None or self.server_name is not None):
            return f"{n.ca_file} is needed to dial workers over TLS: give it too"
        for name, path in ((n.ca_file, self.ca_file), (n.cert_file, self.cert_file),
                           (n.key_file, self.key_file)):  # fmt: skip
            if path is not None and not Path(path).is_file():
                return f"{name} {path}: no such file"
        return ""

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.ca_file is None:
            return None
        key = Path(self.key_file).read_bytes() if self.key_file is not None else None
        chain = Path(self.cert_file).read_bytes() if self.cert_file is not None else None
        return grpc.ssl_channel_credentials(Path(self.ca_file).read_bytes(), key, chain)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
