"""A request every worker refuses is counted under its priority class: the gateway answers
503 with Retry-After, and `kvflow_router_priority_class_rejections_total{reason=
"workers_refused"}` counts it beside admission control's refusals, so the chart's
KvflowRealtimeRejected alert sees realtime requests the workers could not take."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import running_gateway
from testkit.scrape import sample

from kvflow.proto.priority_class import HEADER
from kvflow.router.tenants.config import hash_api_key

pytestmark = pytest.mark.integration

KEY = "sk-acme-0123456789"
METRIC = "kvflow_router_priority_class_rejections_total"


def test_a_request_every_worker_refuses_counts_under_its_class(tmp_path: Path) -> None:
    worker = FakeWorker(model="m", mode="busy")
    tenants = [{"name": "acme", "api_key_sha256": hash_api_key(KEY),
                "max_priority_class": "realtime"}]  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    with (
        running_fake_worker(worker) as address,
        running_gateway(["--workers", address, "--config", str(path), "--admission", "off"]) as g,
    ):
        g.wait_ready()

        def refused() -> float:
            return sample(f"{g.url}/metrics", METRIC, priority_class="realtime",
                          reason="workers_refused")  # fmt: skip

        assert refused() == 0
        r = httpx.post(
            f"{g.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers={"authorization": f"Bearer {KEY}", HEADER: "realtime"},
            timeout=30,
        )
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert refused() == 1
        normal = sample(f"{g.url}/metrics", METRIC, priority_class="normal",
                        reason="workers_refused")  # fmt: skip
        assert normal == 0
