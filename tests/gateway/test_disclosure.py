"""What a gateway with tenants tells whom, against a real router process: cache salts from
the server's secret and each prompt_cache_key, no model names for anonymous callers
(/openapi.json, /ready), and a tenants file that fails to reload made visible (a metric,
/ready, the audit trail) while the last good keys stay in force."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import launch_gateway
from testkit.scrape import sample

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.tenants.salts import tenant_salt, user_salt

pytestmark = pytest.mark.integration

SECRET = b"the-replicas-salt-secret"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-0123456789"
RELOAD_S = 5.0  # tenants/source.py, RELOAD_INTERVAL_S


def complete(url: str, key: str, **extra: object) -> httpx.Response:
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip


def test_salts_come_from_the_secret_and_each_prompt_cache_key(tmp_path: Path) -> None:
    tenants = [
        {"name": "alice", "api_key_sha256": hash_api_key(ALICE), "models": ["fake"]},
        {"name": "bob", "api_key_sha256": hash_api_key(BOB), "models": ["other"]},
    ]
    config, secret = tmp_path / "router.yaml", tmp_path / "secret"
    config.write_text(yaml.safe_dump({"tenants": tenants}))
    secret.write_bytes(SECRET)
    worker = FakeWorker(tokens=(1, 2))
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--workers", address, "--config", str(config),
                            "--cache-salt-secret-file", str(secret)])  # fmt: skip
        try:
            g.wait_ready(num_workers=1)
            for extra in ({}, {"prompt_cache_key": "u1"}, {"prompt_cache_key": "u1"},
                          {"prompt_cache_key": "u2"}):  # fmt: skip
                assert complete(g.url, ALICE, **extra).status_code == 200
            # Anonymous callers learn no model names; a tenant learns its own.
            anonymous = httpx.get(f"{g.url}/openapi.json").json()
            schemas = anonymous["components"]["schemas"]
            assert schemas["CompletionRequest"]["properties"]["model"] == {"type": "string"}
            assert "fake" not in json.dumps(anonymous)
            own = httpx.get(f"{g.url}/openapi.json", headers={"authorization": f"Bearer {ALICE}"})
            model = own.json()["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
            assert model == {"type": "string", "enum": ["fake"]}
            ready = httpx.get(f"{g.url}/ready")
            assert ready.status_code == 200 and "fake" not in ready.text
        finally:
            g.stop()
    plain, one, one_again, two = (r.context.cache_salt for r in worker.requests)
    alice = tenant_salt(SECRET, "alice")
    assert plain == alice  # without a key: the tenant's salt, shared by its users
    assert one == one_again == user_salt(alice, "u1")  # one user's requests share blocks
    assert len({plain, one, two}) == 3  # ... and no one else's


def read_audit(log: str) -> list[dict[str, object]]:
    """The audit events in a router's log (one JSON object per kvflow.audit line)."""
    return [json.loads(line.split("kvflow.audit: ", 1)[1]) for line in log.splitlines()
            if "kvflow.audit: " in line]  # fmt: skip


def test_a_tenants_file_that_fails_to_reload_is_counted_shown_and_audited(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump([{"name": "alice", "api_key_sha256": hash_api_key(ALICE)}]))
    with running_fake_worker(FakeWorker(tokens=(1, 2))) as address:
        g = launch_gateway(["--workers", address, "--tenants-file", str(path)])
        try:
            g.wait_ready(num_workers=1)
            assert httpx.get(f"{g.url}/ready").json()["tenants_stale"] is False
            # A revocation that breaks the file: Bob replaces Alice, with a typo.
            path.write_text(f"- {{name: bob, api_key_sha256: [{hash_api_key(BOB)}], oops: 1}}\n")
            deadline = time.monotonic() + RELOAD_S + 10
            while not httpx.get(f"{g.url}/ready").json()["tenants_stale"]:
                assert time.monotonic() < deadline, "the failed reload never showed"
                time.sleep(0.3)
            metrics = f"{g.url}/metrics"
            assert sample(metrics, "kvflow_router_tenants_reload_failures_total") == 1
            assert sample(metrics, "kvflow_router_tenants_stale") == 1
            assert complete(g.url, ALICE).status_code == 200  # the last good keys, in force
            # Fixed: Bob in, Alice out.
            path.write_text(yaml.safe_dump([{"name": "bob", "api_key_sha256": hash_api_key(BOB)}]))
            deadline = time.monotonic() + RELOAD_S + 10
            while httpx.get(f"{g.url}/ready").json()["tenants_stale"]:
                assert time.monotonic() < deadline, "the good file was never loaded"
                time.sleep(0.3)
            assert complete(g.url, ALICE).status_code == 401
            assert complete(g.url, BOB).status_code == 200
            assert sample(metrics, "kvflow_router_tenants_stale") == 0
        finally:
            g.stop()
    log = "".join(g.log)
    loaded, failed, applied = read_audit(log)
    assert (loaded["event"], loaded["source"]) == ("tenants_loaded", str(path))
    assert loaded["tenants_added"] == ["alice"]
    assert loaded["keys_added"] == {"alice": [hash_api_key(ALICE)[:8]]}
    assert (failed["outcome"], failed["num_tenants_in_force"]) == ("failed", 1)
    assert "oops" in str(failed["error"])
    assert applied["outcome"] == "applied"
    assert (applied["tenants_added"], applied["tenants_removed"]) == (["bob"], ["alice"])
    assert applied["keys_removed"] == {"alice": [hash_api_key(ALICE)[:8]]}
    assert applied["keys_added"] == {"bob": [hash_api_key(BOB)[:8]]}
    # Never key material: neither a key nor a whole digest.
    for secret in (ALICE, BOB, hash_api_key(ALICE), hash_api_key(BOB)):
        assert secret not in log


def test_ready_names_the_pools_models_only_to_a_caller_with_a_key(tmp_path: Path) -> None:
    with running_fake_worker(FakeWorker(tokens=(1, 2))) as address:
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump({
            "tenants": [{"name": "alice", "api_key_sha256": hash_api_key(ALICE)}],
            "pools": [{"name": "main", "served_model_name": "secret-model",
                       "workers": [address]}],
        }))  # fmt: skip
        g = launch_gateway(["--config", str(config)])
        try:
            g.wait_ready(num_workers=1)
            anonymous = httpx.get(f"{g.url}/ready")
            assert anonymous.status_code == 200 and anonymous.json()["workers_healthy"] == 1
            assert "pools" not in anonymous.json() and "secret-model" not in anonymous.text
            with_key = httpx.get(f"{g.url}/ready", headers={"authorization": f"Bearer {ALICE}"})
            assert with_key.json()["pools"]["main"]["served_model_name"] == "secret-model"
        finally:
            g.stop()
