"""The planner's Prometheus source, pure parts: the query it sends, how an answer becomes
per-target `Metrics`, and what the planner decides when Prometheus gives none.

The answer against a real Prometheus scraping real processes is
tests/operator/test_planner_prometheus.py; here, answers in the API's own JSON shape.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvflow.operator.api.schema import from_json
from kvflow.operator.api.v1alpha1 import InferencePoolSpec
from kvflow.operator.observe.promql import SERIES_LABEL, AnswerError, fold, pool_query
from kvflow.operator.planner.config import config_from_spec
from kvflow.operator.planner.types import Observation
from kvflow.operator.planning import _hold

TTFT = "kvflow_worker_time_to_first_token_seconds"


def sample(series: str, value: float | str, **labels: str) -> dict[str, Any]:
    return {"metric": {SERIES_LABEL: series, **labels}, "value": [1700000000.0, str(value)]}


def vector(*samples: dict[str, Any]) -> dict[str, Any]:
    return {"resultType": "vector", "result": list(samples)}


def test_the_query_selects_the_pool_and_tags_every_series() -> None:
    q = pool_query("team-a", 'po"ol', 29.6)
    assert 'namespace="team-a",pool="po\\"ol"' in q  # quoted, never spliced raw
    assert "increase(kvflow_worker_requests_finished_total{" in q
    # The batch class's series are left out: the planner sizes for the online classes.
    selector = 'namespace="team-a",pool="po\\"ol",priority_class!="batch"'
    assert f"increase({TTFT}_bucket{{{selector}}}[30s])" in q
    assert "kvflow_router_ttft_seconds_sum" in q and "kvflow_router_tpot_seconds_count" in q
    # Gauges are read now, not over the window; their name is kept as the tag.
    assert '{__name__=~"kvflow_worker_requests_running|' in q
    # The routers' refusals: demand no worker saw (observe/observation.py).
    assert "increase(kvflow_router_admission_rejections_total{" in q
    assert q.count(" or ") == 4 + 5 * 3  # counters, histogram parts, one gauge term


def test_an_answer_folds_per_target_like_a_scrape() -> None:
    w1, w2, r = "10.0.0.1:9400", "10.0.0.2:9400", "10.0.0.9:9401"
    answer = vector(
        sample("kvflow_worker_requests_finished_total", 6, instance=w1, role="colocated",
               finish_reason="stop"),
        sample("kvflow_worker_requests_finished_total", 2, instance=w1, role="colocated",
               finish_reason="length"),
        sample("kvflow_worker_requests_finished_total", 3, instance=w2, role="colocated"),
        sample("kvflow_worker_kv_cache_usage_ratio", 0.25, instance=w1, role="colocated"),
        sample(f"{TTFT}_bucket", 1, instance=w1, role="colocated", le="0.1"),
        # Extrapolated on its own, the middle bucket came back below the first: repaired.
        sample(f"{TTFT}_bucket", 0.9, instance=w1, role="colocated", le="0.5"),
        sample(f"{TTFT}_bucket", 4, instance=w1, role="colocated", le="+Inf"),
        sample(f"{TTFT}_sum", 2.5, instance=w1, role="colocated"),
        sample(f"{TTFT}_count", 4, instance=w1, role="colocated"),
        sample("kvflow_router_ttft_seconds_count", "NaN", instance=r),  # one sample: no rate
        sample("kvflow_router_ttft_seconds_bucket", 5, instance=r, le="+Inf"),
        sample("kvflow_router_admission_rejections_total", 7, instance=r, code="503",
               reason="cluster_full"),
        sample("kvflow_router_admission_rejections_total", 1, instance=r, code="429",
               reason="over_share"),
    )  # fmt: skip
    got = fold(answer)
    assert set(got.workers) == {"colocated"}
    assert set(got.workers["colocated"]) == {w1, w2}
    first = got.workers["colocated"][w1]
    assert first.counters == {"kvflow_worker_requests_finished": 8.0}  # labels summed
    assert first.gauges == {"kvflow_worker_kv_cache_usage_ratio": 0.25}
    h = first.histograms[TTFT]
    assert h.bounds == (0.1, 0.5, math.inf)
    assert h.cumulative == (1.0, 1.0, 4.0) and h.count == 4.0 and h.sum == 2.5
    assert got.routers[r].histograms["kvflow_router_ttft_seconds"].count == 5.0
    assert got.routers[r].counters == {"kvflow_router_admission_rejections": 8.0}


def test_answers_that_are_not_an_instant_vector_are_refused() -> None:
    with pytest.raises(AnswerError, match="instant vector"):
        fold({"resultType": "matrix", "result": []})
    with pytest.raises(AnswerError, match="not a number"):
        fold(vector(sample("kvflow_worker_requests_waiting", "many")))
    with pytest.raises(AnswerError, match="not a sample"):
        fold(vector("x"))  # type: ignore[arg-type]


def test_without_prometheus_every_planned_role_holds_and_status_says_why() -> None:
    spec = from_json(
        InferencePoolSpec,
        {
            "model": {"servedName": "sim"},
            "mode": "disaggregated",
            "prefill": {"replicas": 2, "maxReplicas": 4},
            "decode": {"replicas": 3, "maxReplicas": 6},
            "autoscaling": {"enabled": True, "manualRoles": ["prefill"],
                            "prometheus": {"url": "http://prometheus:9090"}},
        },
    )  # fmt: skip
    config = config_from_spec(spec)
    observations = {
        "prefill": Observation(time_s=10.0, desired_replicas=2, ready_replicas=2),
        "decode": Observation(time_s=10.0, desired_replicas=5, ready_replicas=4),
    }
    outcome = _hold(config, observations, "http://prometheus:9090/api/v1/query: refused")  # type: ignore[arg-type]
    assert outcome.scaled_roles == ("decode",)  # prefill is pinned: not the planner's
    (decision,) = outcome.decisions
    assert (decision.role, decision.replicas, decision.previous_replicas) == ("decode", 5, 5)
    assert decision.reason == "PrometheusUnavailable" and not decision.is_change
    assert "refused" in decision.message
    assert (outcome.slo.status, outcome.slo.reason) == ("Unknown", "PrometheusUnavailable")
