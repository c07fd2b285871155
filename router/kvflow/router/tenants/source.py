"""The tenants in force: from `--config`, or from a file that is re-read when it changes.

On Kubernetes the tenants come from a Secret the user owns (the pool's
``router.tenantsSecret``), mounted into the router pod as a file: the kubelet replaces a
mounted Secret's files in place when the Secret changes (within about a minute), and this
source re-reads the file every few seconds, so adding a tenant or rotating a key needs no
restart. The check rides on requests and probes (at most one small file read every
RELOAD_INTERVAL_S, on the request that finds the interval over): no task to start or stop.
A file that no longer parses keeps the tenants in force (a typo must not lock every tenant
out), and says so everywhere an operator looks: the log, the audit trail, a metric and
/ready. The file holds the ``tenants:`` section of the router's config (the same schema,
docs/router.md), or just its list.

HMAC digests (``api_key_hmac_sha256``) are checked under ``KVFLOW_TENANT_KEY_SECRET``, read
once at start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from kvflow.router.tenants.audit import audit, tenants_diff
from kvflow.router.tenants.config import TenantConfigError, TenantDirectory, parse_tenants

KEY_SECRET_ENV = "KVFLOW_TENANT_KEY_SECRET"
RELOAD_INTERVAL_S = 5.0

log = logging.getLogger(__name__)


def key_secret_from_env() -> bytes | None:
    secret = os.environ.get(KEY_SECRET_ENV)
    return secret.encode() if secret else None


def parse_tenants_file(text: str, key_secret: bytes | None) -> TenantDirectory:
    """Pure: a tenants file's text as a directory (TenantConfigError when it is invalid)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantConfigError(f"the tenants file is not YAML: {exc}") from exc
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - {"tenants"})
        if unknown:
            raise TenantConfigError(f"the tenants file has unknown sections {unknown}")
        raw = raw.get("tenants")
    if raw is not None and not isinstance(raw, list):
        raise TenantConfigError("the tenants file holds a list of tenants (or tenants: [...])")
    directory = parse_tenants(raw).with_key_secret(key_secret)
    if directory.is_open:  # an empty Secret must not open the gateway to every caller
        raise TenantConfigError(
            "the tenants file declares no tenants (a gateway without tenants accepts any "
            "API key: leave --tenants-file out to run it open)"
        )
    return directory


class TenantSource:
    """The current TenantDirectory, kept in step with the file (if any). Every load and
    reload is an audit event (tenants/audit.py); a reload that fails leaves the last good
    tenants in force and says so: `stale` (the gateway's /ready and a gauge), the
    ``on_reload_failure`` hook (a counter), an error log and an audit event."""

    def __init__(
        self,
        configured: TenantDirectory,
        path: Path | None,
        key_secret: bytes | None,
        *,
        salt_secret: bytes | None = None,
        interval_s: float = RELOAD_INTERVAL_S,
        clock_s: Callable[[], float] = time.monotonic,
        on_reload_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """Raises TenantConfigError when the tenants cannot be served as configured (both a
        config section and a file, an unreadable or invalid file, HMAC digests without
        the secret): at start a clear error beats a gateway that refuses everyone.
        ``salt_secret``: what derived cache salts are derived under (None: a secret of
        this process's, tenants/config.py)."""
        if path is not None and not configured.is_open:
            raise TenantConfigError(
                "tenants come from the config's tenants section or from --tenants-file, not both"
            )
        self.path = path
        self._key_secret = key_secret
        self._salt_secret = salt_secret
        self._interval_s, self._clock_s = interval_s, clock_s
        self._on_reload_failure = on_reload_failure
        self._next_check_s = clock_s() + interval_s
        self._digest = b""
        # The last reload's error while the tenants in force are older than the file.
        self.last_error: str | None = None
        self._directory = self._finish(configured.with_key_secret(key_secret))
        if path is not None:
            text = self._read()
            self._directory = self._finish(parse_tenants_file(text, key_secret))
            self._digest = hashlib.sha256(text.encode()).digest()
        if not self._directory.is_open:
            audit("tenants_loaded", self.source, **tenants_diff(None, self._directory))

    @property
    def source(self) -> str:
        return str(self.path) if self.path is not None else "config"

    @property
    def is_stale(self) -> bool:
        """The file changed and could not be loaded: older tenants (keys) are in force."""
        return self.last_error is not None

    def _finish(self, directory: TenantDirectory) -> TenantDirectory:
        secret = self._salt_secret
        return directory.with_salt_secret(secret) if secret is not None else directory

    @property
    def current(self) -> TenantDirectory:
        """The tenants in force, re-read first when the file's interval is over."""
        if self.path is not None and self._clock_s() >= self._next_check_s:
            self._next_check_s = self._clock_s() + self._interval_s
            self.reload_if_changed()
        return self._directory

    def _read(self) -> str:
        assert self.path is not None
        try:
            return self.path.read_text()
        except OSError as exc:
            raise TenantConfigError(f"cannot read the tenants file {self.path}: {exc}") from exc

    def reload_if_changed(self) -> bool:
        """Re-read the file; True when new tenants took effect. Never raises."""
        if self.path is None:
            return False
        try:
            text = self._read()
            digest = hashlib.sha256(text.encode()).digest()
            if digest == self._digest:
                return False
            self._digest = digest  # a broken file is reported once, not every interval
            directory = self._finish(parse_tenants_file(text, self._key_secret))
        except TenantConfigError as exc:
            self._reload_failed(str(exc))
            return False
        diff = tenants_diff(self._directory, directory)
        self._directory = directory
        self.last_error = None
        audit("tenants_reloaded", self.source, outcome="applied", **diff)
        log.info("tenants reloaded from %s: %d tenants", self.path, len(directory.tenants))
        return True

    def _reload_failed(self, error: str) -> None:
        if error == self.last_error:
            return  # the same unreadable file, met again: already counted and logged
        self.last_error = error
        self._on_reload_failure()
        audit("tenants_reloaded", self.source, outcome="failed", error=error,
              num_tenants_in_force=len(self._directory.tenants))  # fmt: skip
        log.error("keeping the tenants in force (a revoked key still works until the file "
                  "loads): %s", error)  # fmt: skip
