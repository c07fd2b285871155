"""A role scaled to zero comes back when requests come for it: with no worker to read, the
gateway's refusals (kvflow_router_admission_rejections{reason="no_worker"}) are its demand.
Without them it read as "metrics missing" and stayed at zero for good."""

from __future__ import annotations

from planner.history import Run, config

from kvflow.operator.observe.exposition import Metrics
from kvflow.operator.observe.observation import Slo, Targets, observe_role
from kvflow.operator.observe.pods import RolePods
from kvflow.operator.planner import Observation
from kvflow.proto.metric_names import ROUTER_SHED

SLO = Slo(ttft_target_s=1.0, tpot_target_s=0.1, percentile=90)


def _at_zero(refused: float) -> tuple[Run, Observation]:
    run = Run(config("colocated", replicas=0, min_replicas=0, max_replicas=4))
    routers = [Metrics({ROUTER_SHED: refused})]
    targets = Targets(workers=[], routers=routers)
    obs = observe_role("colocated", time_s=0.0, window_s=30.0, desired_replicas=0,
                       pods=RolePods(), slo=SLO, targets=targets)  # fmt: skip
    return run, obs


def test_requests_refused_for_want_of_a_worker_bring_one_back() -> None:
    run, obs = _at_zero(15.0)
    assert obs.request_rate_per_s == 0.5  # 15 refused over 30 s
    decision = run.step("colocated", obs)
    assert (decision.previous_replicas, decision.replicas) == (0, 1), decision


def test_no_request_leaves_it_at_zero() -> None:
    run, obs = _at_zero(0.0)
    assert obs.request_rate_per_s == 0.0
    assert run.step("colocated", obs).replicas == 0
