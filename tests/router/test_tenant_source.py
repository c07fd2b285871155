"""Tenants from a file that changes under a running gateway (a mounted Secret), with
SHA-256 or HMAC key digests. Real files; the gateway-level test is in tests/gateway."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvflow.router.tenants.config import (
    TenantConfigError,
    hash_api_key,
    hmac_api_key,
    parse_tenants,
)
from kvflow.router.tenants.source import TenantSource, parse_tenants_file

SECRET = b"server-side-secret"


def entry(name: str, key: str, *, hmac_secret: bytes | None = None) -> str:
    if hmac_secret is None:
        return f"- name: {name}\n  api_key_sha256: [{hash_api_key(key)}]\n"
    return f"- name: {name}\n  api_key_hmac_sha256: [{hmac_api_key(key, hmac_secret)}]\n"


def names(source: TenantSource, *keys: str) -> list[str | None]:
    found = [source.current.lookup(k) for k in keys]
    return [None if t is None else t.name for t in found]


def test_both_file_forms_and_both_digests(tmp_path: Path) -> None:
    as_list = entry("a", "sk-a") + entry("b", "sk-b", hmac_secret=SECRET)
    as_section = "tenants:\n" + "".join("  " + line + "\n" for line in as_list.splitlines())
    for text in (as_list, as_section):
        path = tmp_path / "tenants.yaml"
        path.write_text(text)
        source = TenantSource(parse_tenants(None), path, SECRET)
        assert names(source, "sk-a", "sk-b", "sk-c") == ["a", "b", None]
    # The HMAC digest is worthless without the server's secret, and with another one.
    other = TenantSource(parse_tenants(None), path, b"another-secret")
    assert names(other, "sk-a", "sk-b") == ["a", None]
    with pytest.raises(TenantConfigError, match="KVFLOW_TENANT_KEY_SECRET"):
        TenantSource(parse_tenants(None), path, None)


def test_a_changed_file_takes_effect_and_a_broken_one_keeps_the_tenants(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(entry("a", "sk-a"))
    source = TenantSource(parse_tenants(None), path, None)
    assert not source.reload_if_changed()  # nothing changed
    path.write_text(entry("b", "sk-b"))  # a's key revoked, b added
    assert source.reload_if_changed()
    assert names(source, "sk-a", "sk-b") == [None, "b"]
    with caplog.at_level(logging.ERROR):
        path.write_text(entry("c", "sk-c") + "  requests_per_minute: -1\n")
        assert not source.reload_if_changed()
        assert not source.reload_if_changed()
    assert names(source, "sk-b", "sk-c") == ["b", None]
    errors = [r for r in caplog.records if "keeping the tenants in force" in r.message]
    assert len(errors) == 1 and "requests_per_minute" in errors[0].message
    path.write_text("")  # emptied: keeps them too, rather than opening the gateway
    assert not source.reload_if_changed()
    assert names(source, "sk-b") == ["b"]
    path.unlink()  # an unreadable file (a Secret deleted) keeps them too
    assert not source.reload_if_changed()
    assert names(source, "sk-b") == ["b"]


def test_a_change_is_seen_by_the_first_lookup_after_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(entry("a", "sk-a"))
    now = [0.0]
    source = TenantSource(parse_tenants(None), path, None, interval_s=5, clock_s=lambda: now[0])
    # As the kubelet updates a mounted Secret: a new file swapped in by rename.
    staged = tmp_path / "staged.yaml"
    staged.write_text(entry("a", "sk-rotated"))
    staged.replace(path)
    now[0] = 4.9
    assert names(source, "sk-a", "sk-rotated") == ["a", None]  # not yet re-read
    now[0] = 5.0
    assert names(source, "sk-a", "sk-rotated") == [None, "a"]


def test_start_refuses_what_it_could_not_serve(tmp_path: Path) -> None:
    configured = parse_tenants([{"name": "x", "api_key_sha256": hash_api_key("sk-x")}])
    path = tmp_path / "tenants.yaml"
    path.write_text(entry("a", "sk-a"))
    with pytest.raises(TenantConfigError, match="not both"):
        TenantSource(configured, path, None)
    with pytest.raises(TenantConfigError, match="cannot read the tenants file"):
        TenantSource(parse_tenants(None), tmp_path / "missing.yaml", None)
    for text, fragment in [
        ("tenants: {a: 1}", "a list of tenants"),
        ("[unclosed", "not YAML"),
        ("routing: {}\ntenants: []", "unknown sections"),
    ]:
        with pytest.raises(TenantConfigError, match=fragment):
            parse_tenants_file(text, None)
    # An empty file (an empty Secret) must not open the gateway to every caller.
    for empty in ("", "tenants: []", "[]"):
        with pytest.raises(TenantConfigError, match="declares no tenants"):
            parse_tenants_file(empty, None)
    # Without a file the config's tenants stand.
    assert names(TenantSource(configured, None, None), "sk-x") == ["x"]
