"""schemathesis against a real gateway and simulated workers, short enough for CI (~45 s).

The long run (thousands of requests) is `tests/fuzz/gateway_fuzz.py` by hand; its numbers
are in docs/benchmarks.md, "Fuzzing".
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest
from fuzz.gateway_fuzz import MODEL, run_schemathesis, sim_gateway

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_gateway_serves_its_schema_and_survives_schemathesis(tmp_path: Path) -> None:
    with sim_gateway() as gateway:
        schema = httpx.get(f"{gateway.url}/openapi.json", timeout=10).json()
        chat = schema["components"]["schemas"]["ChatCompletionRequest"]
        assert chat["properties"]["model"]["enum"] == [MODEL]
        assert chat["additionalProperties"] is False
        # A different seed each run would be more coverage but a flaky CI; seeds change by hand.
        result = run_schemathesis(gateway, tmp_path, max_examples=8, seed=7, max_time_s=35)
    summary = json.dumps(asdict(result), indent=1)
    assert result.num_requests >= 300, summary
    assert result.statuses.get("200", 0) >= 50, summary  # generation really ran
    assert result.num_unexplained_5xx == 0, summary
    assert result.failures == [], summary
