"""The audit trail of the tenants in force: what a load or reload changed, as one JSON line
on the ``kvflow.audit`` logger. Who may call and with which key is security state: a
revocation must leave a record, and a failed one must be visible.

Keys appear only as fingerprints: the first 8 hex digits of their configured digest (the
SHA-256 of the key for ``api_key_sha256``, the HMAC for ``api_key_hmac_sha256``), enough
to tell keys apart in a rotation, useless for finding a key. The diff is pure.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvflow.router.tenants.config import Tenant, TenantDirectory

audit_log = logging.getLogger("kvflow.audit")
# Kept under --log-level warning too: the trail is not chatter.
audit_log.setLevel(logging.INFO)

FINGERPRINT_HEX_DIGITS = 8
# Compared to tell a changed tenant; the salt is left out (its value is a secret's output).
_COMPARED = tuple(f.name for f in fields(Tenant) if f.name not in ("name", "cache_salt"))


def key_fingerprints(directory: TenantDirectory) -> dict[str, set[str]]:
    """Per tenant, the fingerprints of its keys' digests."""
    prints: dict[str, set[str]] = {name: set() for name in directory.tenants}
    for digest, name in directory.key_digests():
        prints[name].add(digest[:FINGERPRINT_HEX_DIGITS])
    return prints


def _changed_fields(old: Tenant, new: Tenant) -> list[str]:
    changed = [name for name in _COMPARED if getattr(old, name) != getattr(new, name)]
    if old.cache_salt != new.cache_salt and "is_salt_derived" not in changed:
        changed.append("cache_salt")
    return changed


def _by_name(prints: Mapping[str, set[str]], other: Mapping[str, set[str]]) -> dict[str, list[str]]:
    """Fingerprints in ``prints`` and not in ``other``, per tenant that has any."""
    out = {name: sorted(p - other.get(name, set())) for name, p in prints.items()}
    return {name: p for name, p in sorted(out.items()) if p}


def tenants_diff(old: TenantDirectory | None, new: TenantDirectory) -> dict[str, Any]:
    """What changed from ``old`` (None: nothing was in force) to ``new``."""
    before = old.tenants if old is not None else {}
    old_prints = key_fingerprints(old) if old is not None else {}
    new_prints = key_fingerprints(new)
    changed = {name: _changed_fields(before[name], t) for name, t in new.tenants.items()
               if name in before}  # fmt: skip
    return {
        "tenants_added": sorted(set(new.tenants) - set(before)),
        "tenants_removed": sorted(set(before) - set(new.tenants)),
        "tenants_changed": {name: f for name, f in sorted(changed.items()) if f},
        "keys_added": _by_name(new_prints, old_prints),
        "keys_removed": _by_name(old_prints, new_prints),
        "num_tenants": len(new.tenants),
    }


def audit(event: str, source: str, **details: Any) -> dict[str, Any]:
    """Log one audit event (a JSON object on one line) and return it."""
    record = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "source": source, **details}  # fmt: skip
    audit_log.info(json.dumps(record, sort_keys=True))
    return record
