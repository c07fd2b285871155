"""A real router whose Redis dies, told to deny meanwhile: 503 with Retry-After in OpenAI's
shape, counted, and served again once Redis is back."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import launch_gateway
from testkit.redis_server import running_redis
from testkit.scrape import sample

from kvflow.router.tenants.config import hash_api_key

pytestmark = pytest.mark.integration

KEY = "sk-quota-store-0123456789"


def test_a_router_told_to_deny_answers_503_while_redis_is_down(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    tenant = {"name": "t", "api_key_sha256": hash_api_key(KEY), "requests_per_minute": 1000}
    config.write_text(yaml.safe_dump({"tenants": [tenant]}))
    with running_redis() as redis, running_fake_worker(FakeWorker(tokens=(1, 2))) as address:
        g = launch_gateway(["--workers", address, "--config", str(config), "--redis-url",
                            redis.url, "--quota-on-store-failure", "deny",
                            "--quota-scope", "ns/pool"])  # fmt: skip
        try:
            g.wait_ready(num_workers=1)
            body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
            auth = {"authorization": f"Bearer {KEY}"}

            def ask() -> httpx.Response:
                return httpx.post(f"{g.base_url}/completions", json=body, headers=auth, timeout=30)

            assert ask().status_code == 200
            redis.stop()
            r = ask()
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "quota_store_unavailable"
            metrics = f"{g.url}/metrics"
            assert sample(metrics, "kvflow_router_quota_store_fallbacks_total", action="deny") == 1
            redis.start()
            deadline = time.monotonic() + 15
            while (r := ask()).status_code != 200:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.5)
        finally:
            g.stop()
