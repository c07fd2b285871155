"""Cache salts and the tenants audit diff, pure: salts need the server's secret and split
per prompt_cache_key; the diff names tenants and key fingerprints, never keys."""

from __future__ import annotations

import json
import logging

import pytest

from kvflow.router.tenants.audit import audit, tenants_diff
from kvflow.router.tenants.config import hash_api_key, parse_tenants
from kvflow.router.tenants.prompt_cache import tenant_for_request
from kvflow.router.tenants.salts import tenant_salt, user_salt
from kvflow.router.tenants.source import TenantSource


def directory(*tenants: dict[str, object]):  # type: ignore[no-untyped-def]
    return parse_tenants(list(tenants))


def test_default_salts_are_not_derivable_from_the_name_alone() -> None:
    raw = {"name": "acme", "api_key_sha256": hash_api_key("k")}
    # Two processes without a configured secret: different salts (random secrets) ...
    first = TenantSource(directory(raw), None, None).current.tenants["acme"]
    assert first.is_salt_derived
    # ... and with one secret, the same salt on every replica, which is its HMAC.
    a = TenantSource(directory(raw), None, None, salt_secret=b"s").current.tenants["acme"]
    b = TenantSource(directory(raw), None, None, salt_secret=b"s").current.tenants["acme"]
    assert a.cache_salt == b.cache_salt == tenant_salt(b"s", "acme") != first.cache_salt
    assert tenant_salt(b"t", "acme") != a.cache_salt
    # A salt given in the config is kept as is.
    given = {**raw, "cache_salt": "shared-with-partner"}
    kept = TenantSource(directory(given), None, None, salt_secret=b"s").current.tenants["acme"]
    assert kept.cache_salt == "shared-with-partner" and not kept.is_salt_derived


@pytest.mark.parametrize("key", ["u1", 7, {"user": "u1"}])
def test_a_prompt_cache_key_narrows_the_tenants_salt(key: object) -> None:
    tenant = directory({"name": "acme", "api_key_sha256": hash_api_key("k")}).tenants["acme"]
    assert tenant_for_request(tenant, {"prompt": "x"}) is tenant
    assert tenant_for_request(tenant, {"prompt_cache_key": None}) is tenant
    narrowed = tenant_for_request(tenant, {"prompt_cache_key": key})
    assert narrowed.cache_salt not in (tenant.cache_salt, user_salt(tenant.cache_salt, "u2"))
    assert narrowed == tenant_for_request(tenant, {"prompt_cache_key": key})
    assert (narrowed.name, narrowed.quotas, narrowed.priority) == (
        tenant.name, tenant.quotas, tenant.priority)  # fmt: skip
    # The same key under another tenant is another salt.
    other = directory({"name": "other", "api_key_sha256": hash_api_key("o")}).tenants["other"]
    assert tenant_for_request(other, {"prompt_cache_key": key}).cache_salt != narrowed.cache_salt


def test_the_diff_names_tenants_changes_and_key_fingerprints() -> None:
    old = directory(
        {"name": "a", "api_key_sha256": [hash_api_key("ka1"), hash_api_key("ka2")]},
        {"name": "b", "api_key_sha256": hash_api_key("kb"), "priority": 1},
        {"name": "gone", "api_key_sha256": hash_api_key("kg")},
    )
    new = directory(
        {"name": "a", "api_key_sha256": [hash_api_key("ka2"), hash_api_key("ka3")]},
        {"name": "b", "api_key_sha256": hash_api_key("kb"), "priority": 2,
         "requests_per_minute": 5},
        {"name": "new", "api_key_sha256": hash_api_key("kn")},
    )  # fmt: skip
    diff = tenants_diff(old, new)
    assert diff["tenants_added"] == ["new"] and diff["tenants_removed"] == ["gone"]
    assert diff["tenants_changed"] == {"b": ["priority", "quotas"]}
    assert diff["keys_added"] == {"a": [hash_api_key("ka3")[:8]], "new": [hash_api_key("kn")[:8]]}
    assert diff["keys_removed"] == {"a": [hash_api_key("ka1")[:8]],
                                    "gone": [hash_api_key("kg")[:8]]}  # fmt: skip
    assert tenants_diff(new, new)["tenants_changed"] == {}


def test_an_audit_event_is_one_json_line_on_kvflow_audit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvflow.audit"):
        audit("tenants_reloaded", "/etc/tenants.yaml", outcome="applied", num_tenants=2)
    (record,) = caplog.records
    assert record.name == "kvflow.audit"
    event = json.loads(record.getMessage())
    assert event["event"] == "tenants_reloaded" and event["source"] == "/etc/tenants.yaml"
    assert event["outcome"] == "applied" and event["time"].endswith("Z")
