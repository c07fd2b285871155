"""The `pools:` section: several pools (one model each) behind one gateway.

```yaml
pools:
  - name: smollm-v1                 # unique DNS-1123 label; in logs, errors, route header
    served_model_name: smollm2-v1   # optional; default: the name its workers report
    model: /models/v1/model.gguf    # optional tokenizer + chat template (like --model)
    workers: ["127.0.0.1:50051"]    # exactly one of workers / worker_dns
    worker_dns: kvflow-smollm-v1-workers.default.svc:50051
    disaggregation: {enabled: true} # optional; fields left out take the top-level section's
    worker_tls:                     # optional; left out: the --worker-tls-* flags' setting
      ca_file: /etc/kvflow-worker-tls/smollm-v1/ca.crt    # dial over TLS trusting this CA
      cert_file: /etc/kvflow-worker-tls/smollm-v1/tls.crt # with key_file: mutual TLS
      key_file: /etc/kvflow-worker-tls/smollm-v1/tls.key
      server_name: kvflow-smollm-v1-workers.default.svc   # the name the certificates carry
```

`worker_tls: {}` (no ca_file) dials that pool in plaintext whatever the flags say, so one
gateway fronts TLS and plaintext pools together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvflow.router.config_fields import ConfigError, check_keys, parse_disaggregation, section
from kvflow.router.routing.placement import DisaggregationConfig
from kvflow.router.workers.discovery import DiscoveryConfigError, parse_address
from kvflow.router.workers.tls import TlsFieldNames, WorkerTls

# A DNS-1123 label, as Kubernetes names its objects: the operator renders pool names from
# InferencePool names, and they appear in log lines and headers.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class PoolSpec:
    name: str
    served_model_name: str | None = None  # None: whatever its workers report
    model: str | None = None  # tokenizer + chat template; None: the built-in SmolLM2 GGUF
    workers: tuple[str, ...] = ()
    worker_dns: str | None = None  # NAME:PORT of a headless Service
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    worker_tls: WorkerTls | None = None  # None: the --worker-tls-* flags' (cli_security.py)

    def tls(self, default: WorkerTls) -> WorkerTls:
        """How to dial this pool's workers; ``default``: the flags' setting."""
        return default if self.worker_tls is None else self.worker_tls


def _optional_str(raw: dict[str, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{where}.{key} must be a non-empty string, got {value!r}")
    return value


def _address(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a host:port string, got {value!r}")
    try:
        parse_address(value)
    except DiscoveryConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return value.strip()


_TLS_KEYS = ("ca_file", "cert_file", "key_file", "server_name")


def _worker_tls(raw: dict[str, Any], where: str) -> WorkerTls | None:
    if "worker_tls" not in raw:
        return None
    value = raw["worker_tls"]
    where = f"{where}.worker_tls"
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping with ca_file, cert_file, key_file, "
                          f"server_name (all optional), got {value!r}")  # fmt: skip
    check_keys(value, set(_TLS_KEYS), where)
    tls = WorkerTls(*(_optional_str(value, key, where) for key in _TLS_KEYS))
    problem = tls.problem(TlsFieldNames(f"{where}.ca_file", f"{where}.cert_file",
                                        f"{where}.key_file"))  # fmt: skip
    if problem:
        raise ConfigError(problem)
    return tls


def _pool(raw: object, where: str, default_disaggregation: DisaggregationConfig) -> PoolSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with name and workers or worker_dns")
    check_keys(raw, {"name", "served_model_name", "model", "workers", "worker_dns",
                     "disaggregation", "worker_tls"}, where)  # fmt: skip
    name = raw.get("name")
    if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name):
        raise ConfigError(
            f"{where}.name must be a DNS-1123 label (lowercase letters, digits and '-', "
            f"at most 63), got {name!r}"
        )
    workers = raw.get("workers")
    worker_dns = raw.get("worker_dns")
    if (workers is None) == (worker_dns is None):
        raise ConfigError(f"{where} needs exactly one of workers and worker_dns")
    if workers is not None and (not isinstance(workers, list) or not workers):
        raise ConfigError(f"{where}.workers must be a non-empty list of host:port")
    return PoolSpec(
        name=name,
        served_model_name=_optional_str(raw, "served_model_name", where),
        model=_optional_str(raw, "model", where),
        workers=tuple(_address(w, f"{where}.workers[{i}]") for i, w in enumerate(workers or [])),
        worker_dns=None if worker_dns is None else _address(worker_dns, f"{where}.worker_dns"),
        disaggregation=parse_disaggregation(
            section(raw, "disaggregation", f"{where}."),
            f"{where}.disaggregation",
            base=default_disaggregation,
        ),
        worker_tls=_worker_tls(raw, where),
    )


def parse_pools(raw: object, default_disaggregation: DisaggregationConfig) -> tuple[PoolSpec, ...]:
    """The `pools:` section; () when absent (one pool from the command line)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise ConfigError("pools must be a non-empty list of {name, workers | worker_dns, ...}")
    pools = tuple(_pool(item, f"pools[{i}]", default_disaggregation) for i, item in enumerate(raw))
    for field_name in ("name", "served_model_name"):
        seen: dict[str, int] = {}
        for i, pool in enumerate(pools):
            value = getattr(pool, field_name)
            if value is None:
                continue
            if value in seen:
                raise ConfigError(
                    f"pools[{i}].{field_name} {value!r} is already pools[{seen[value]}]'s; "
                    "each pool needs its own"
                )
            seen[value] = i
    return pools
