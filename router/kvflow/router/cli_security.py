"""The router's exposure and security flags (docs/router.md, "Security"): the HTTP
listener's limits, TLS, who is an admin without tenants, the quota store, salts and TLS to
workers; and the check that refuses an open router off loopback."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvflow.proto.cli_args import positive_int, seconds
from kvflow.router.api.http_limits import HttpLimits
from kvflow.router.settings import ConfigError, RouterSettings
from kvflow.router.tenants.quota_scope import QUOTA_SCOPE
from kvflow.router.tenants.salts import CACHE_SALT_SECRET_ENV
from kvflow.router.workers.tls import WorkerTls

# --- exposure and security: the HTTP listener, the quota store, disclosure --------------------


def security_flags(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    g = p.add_argument_group("exposure and security (docs/router.md, Security)")
    g.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=d.http.max_header_bytes,
        help="a request line and headers past this get 431 (default: %(default)s)",
    )
    g.add_argument(
        "--header-timeout-s",
        type=seconds(allow_zero=False),
        default=d.http.header_timeout_s,
        help="headers not all in by then (from the connection or the request's "
        "first byte) get 408 (default: %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=d.http.max_connections,
        help="past this many open connections a request gets 503 (default: %(default)s)",
    )
    g.add_argument(
        "--write-timeout-s",
        type=seconds(allow_zero=False),
        default=d.http.write_timeout_s,
        help="a client that reads nothing of a response for this long is cut and "
        "its request's slot and quota freed (default: %(default)s)",
    )
    g.add_argument(
        "--sse-keepalive-interval-s",
        type=seconds(allow_zero=True),
        default=d.sse_keepalive_interval_s,
        help="a quiet stream gets a ': keep-alive' comment this often; 0: never "
        "(default: %(default)s)",
    )
    g.add_argument("--tls-cert-file", help="serve HTTPS with this PEM certificate (chain)")
    g.add_argument("--tls-key-file", help="... and this PEM private key")
    g.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="without tenants, serve anonymous callers (as admins) on a "
        "non-loopback --host too; without it such a router refuses to start",
    )
    g.add_argument(
        "--quota-scope",
        default=d.quota_scope,
        help="namespaces quota keys in a shared Redis: routers with the same scope "
        "share limits (e.g. NAMESPACE/POOL) (default: %(default)s)",
    )
    g.add_argument(
        "--quota-on-store-failure",
        choices=["memory", "deny"],
        default=d.quota_on_store_failure,
        help="when Redis fails: memory (limits per replica, counted in "
        "kvflow_router_quota_store_fallbacks_total) or deny (503 with Retry-After) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--worker-tls-ca-file",
        help="dial workers over TLS, trusting this CA (PEM); what their --tls-cert-file chains "
        "to. The --worker-tls-* flags are the default of --config pools: without worker_tls",
    )
    g.add_argument(
        "--worker-tls-cert-file",
        help="present this certificate to workers (PEM; for workers with --tls-ca-file)",
    )
    g.add_argument("--worker-tls-key-file", help="... and this private key (PEM)")
    g.add_argument(
        "--worker-tls-server-name",
        help="the name the workers' certificates carry (default: the address dialled)",
    )
    g.add_argument(
        "--cache-salt-secret-file",
        help="secret that tenants' default cache salts are derived from; the same "
        f"on every replica (default: ${CACHE_SALT_SECRET_ENV}, else random per "
        "process: replicas then share no prefix cache)",
    )


def read_secret_file(path: str | None, env: Mapping[str, str]) -> bytes | None:
    if path is None:
        value = env.get(CACHE_SALT_SECRET_ENV)
        return value.encode() if value else None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read --cache-salt-secret-file {path}: {exc}") from exc
    if not secret:
        raise ConfigError(f"--cache-salt-secret-file {path} is empty")
    return secret


def security_settings(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ConfigError("--tls-cert-file and --tls-key-file go together: give both")
    worker_tls = WorkerTls(
        args.worker_tls_ca_file,
        args.worker_tls_cert_file,
        args.worker_tls_key_file,
        args.worker_tls_server_name,
    )
    if worker_tls.problem():
        raise ConfigError(worker_tls.problem())
    if not QUOTA_SCOPE.match(args.quota_scope):
        raise ConfigError(
            f"--quota-scope must be 1-128 letters, digits, '.', '_', '-' or '/', "
            f"got {args.quota_scope!r}"
        )
    return {
        "http": HttpLimits(
            args.max_header_bytes, args.header_timeout_s, args.max_connections, args.write_timeout_s
        ),
        "sse_keepalive_interval_s": args.sse_keepalive_interval_s,
        "tls_cert_file": Path(args.tls_cert_file) if args.tls_cert_file else None,
        "tls_key_file": Path(args.tls_key_file) if args.tls_key_file else None,
        "allow_unauthenticated": args.allow_unauthenticated,
        "quota_scope": args.quota_scope,
        "quota_on_store_failure": args.quota_on_store_failure,
        "cache_salt_secret": read_secret_file(args.cache_salt_secret_file, env),
        "worker_tls": worker_tls,
    }


def is_loopback(host: str) -> bool:
    """``host`` (an address or a name) is this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unauthenticated_problem(settings: RouterSettings) -> str | None:
    """Why this router must not start: no tenants, a non-loopback address, no opt-in."""
    is_open = settings.tenants_file is None and settings.config.tenants.is_open
    if not is_open or settings.allow_unauthenticated or is_loopback(settings.host):
        return None
    return (
        f"no tenants are configured and --host {settings.host} is not loopback: anyone who "
        "reaches it would be an admin. Configure tenants (--config's tenants section or "
        "--tenants-file), listen on 127.0.0.1, or pass --allow-unauthenticated to serve "
        "anonymous callers anyway"
    )
