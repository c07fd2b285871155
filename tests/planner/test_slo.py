"""The SLOMet verdict (pure)."""

from __future__ import annotations

import dataclasses

import pytest
from planner.history import TPOT_S, TTFT_S, calm, config

from kvflow.operator.planner import Observation, PlannerConfig, RoleConfig, SloVerdict
from kvflow.operator.planner.slo import judge_slo


def _pd() -> PlannerConfig:
    cfg = config("prefill")
    roles = dict(cfg.roles)
    roles["decode"] = RoleConfig(spec_replicas=2, min_replicas=1, max_replicas=10)
    return dataclasses.replace(cfg, roles=roles)


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        ({}, {}, ("True", "WithinTargets")),
        ({"ttft_s": 1.2 * TTFT_S}, {}, ("False", "TtftAboveTarget")),
        ({}, {"tpot_s": 1.2 * TPOT_S}, ("False", "TpotAboveTarget")),
        ({"ttft_s": 2.0}, {"tpot_s": 0.2}, ("False", "TtftAndTpotAboveTarget")),
        # p90 under target, but 15 % of requests over it (budget 10 %): missed.
        ({"ttft_violation_fraction": 0.15}, {}, ("False", "TtftAboveTarget")),
        ({"ttft_s": None}, {"ttft_s": None}, ("Unknown", "AwaitingMetrics")),
        # A miss is a miss even when the other latency is unmeasured.
        ({"tpot_s": None}, {"tpot_s": 0.5}, ("False", "TpotAboveTarget")),
    ],
)
def test_verdicts(prefill: dict, decode: dict, expected: tuple[str, str]) -> None:  # type: ignore[type-arg]
    verdict = judge_slo(_pd(), {"prefill": calm(0, 2, **prefill), "decode": calm(0, 2, **decode)})
    assert (verdict.status, verdict.reason) == expected
    assert "TTFT p90" in verdict.message and "TPOT p90" in verdict.message


def test_no_traffic_is_not_compliance() -> None:
    idle: dict[str, Observation] = {
        "prefill": calm(0, 1, request_rate_per_s=0.0, ttft_s=None, tpot_s=None),
        "decode": calm(0, 1, request_rate_per_s=0.0, ttft_s=None, tpot_s=None),
    }
    verdict = judge_slo(_pd(), idle)  # type: ignore[arg-type]
    assert verdict == SloVerdict("Unknown", "AwaitingMetrics", "no requests in the window")


def test_refused_requests_are_named_in_the_verdict() -> None:
    """Served requests on time, 20 % refused by admission control: missed, and the message
    says why the fast p90 does not tell the whole story."""
    shed = {"ttft_violation_fraction": 0.2, "shed_fraction": 0.2}
    verdict = judge_slo(_pd(), {"prefill": calm(0, 2, **shed), "decode": calm(0, 2)})
    assert (verdict.status, verdict.reason) == ("False", "TtftAboveTarget")
    assert "20.0% of requests refused by admission control" in verdict.message
    fine = judge_slo(_pd(), {"prefill": calm(0, 2, shed_fraction=0.0), "decode": calm(0, 2)})
    assert fine.status == "True" and "refused" not in fine.message
