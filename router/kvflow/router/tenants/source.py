"""The tenants in force: from `--config`, or from a file that is re-read when it changes.

On Kubernetes the tenants come from a Secret the user owns (the pool's
``router.tenantsSecret``), mounted into the router pod as a file: the kubelet replaces a
mounted Secret's files in place when the Secret changes (within about a minute), and this
source re-reads the file every few seconds, so adding a tenant or rotating a key needs no
restart. The check rides on requests (at most one small file read every RELOAD_INTERVAL_S,
on the request that finds the interval over): no task to start or stop. A file that no
longer parses keeps the tenants in force and logs the error: a
typo must not lock every tenant out. The file holds the ``tenants:`` section of the
router's config (the same schema, docs/router.md), or just its list.

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
    """The current TenantDirectory, kept in step with the file (if any)."""

    def __init__(
        self,
        configured: TenantDirectory,
        path: Path | None,
        key_secret: bytes | None,
        *,
        interval_s: float = RELOAD_INTERVAL_S,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises TenantConfigError when the tenants cannot be served as configured (both a
        config section and a file, an unreadable or invalid file, HMAC digests without
        the secret): at start a clear error beats a gateway that refuses everyone."""
        if path is not None and not configured.is_open:
            raise TenantConfigError(
                "tenants come from the config's tenants section or from --tenants-file, not both"
            )
        self.path = path
        self._key_secret = key_secret
        self._interval_s, self._clock_s = interval_s, clock_s
        self._next_check_s = clock_s() + interval_s
        self._digest = b""
        self._directory = configured.with_key_secret(key_secret)
        if path is not None:
            text = self._read()
            self._directory = parse_tenants_file(text, key_secret)
            self._digest = hashlib.sha256(text.encode()).digest()

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
            directory = parse_tenants_file(text, self._key_secret)
        except TenantConfigError as exc:
            log.error("keeping the tenants in force: %s", exc)
            return False
        self._directory = directory
        log.info("tenants reloaded from %s: %d tenants", self.path, len(directory.tenants))
        return True
