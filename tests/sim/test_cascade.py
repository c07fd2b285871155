"""The model cascade in virtual time (sim/cascade.py): escalation follows the modelled
failure rates, a kept answer reaches the client whole (its first token at its end), an
escalated one only after the small answer ended, and the cost is both pools' tokens."""

from __future__ import annotations

import json
from dataclasses import replace
from io import StringIO
from pathlib import Path

import pytest

from kvflow.sim.cascade import CascadeScenario, plan, run, serve, summary
from kvflow.sim.cascade_cli import main

SMALL = CascadeScenario(num_requests=40, rate_rps=4.0)


def with_failure_rates(easy: float, hard: float) -> CascadeScenario:
    e, h = SMALL.kinds
    return replace(SMALL, kinds=(replace(e, small_failure_rate=easy),
                                 replace(h, small_failure_rate=hard)))  # fmt: skip


def test_nothing_fails_nothing_escalates_and_only_the_small_model_is_paid() -> None:
    result = run(with_failure_rates(0.0, 0.0))
    s = summary(result)
    assert s["escalated_fraction"] == 0 and s["requests"] == 40 and s["failed"] == 0
    # Answered whole, then replayed: the client's first token is the small answer's end.
    planned = plan(result.scenario)
    small = serve(SMALL.small, [(p.request, p.arrival_s) for p in planned], SMALL.seed)
    arrival = {p.request.request_id: p.arrival_s for p in planned}
    for o in result.outcomes:
        assert o.ttft_s == o.e2e_s == small[o.request_id].end_s - arrival[o.request_id]
    # The small model's prices are a tenth of the large one's, for the same tokens.
    assert s["cost_saved_fraction"] == pytest.approx(0.9, abs=0.01)


def test_everything_escalated_costs_more_and_starts_later_than_the_large_model_alone() -> None:
    result = run(with_failure_rates(1.0, 1.0))
    s = summary(result)
    assert s["escalated_fraction"] == 1
    assert s["cost_saved_fraction"] < 0  # the small answers are paid for on top
    # Each escalated request waits for its whole small answer before the large one starts.
    cascade, alone = s["latency"]["escalated"], s["latency"]["all_large"]
    assert cascade["ttft_p50_s"] > alone["ttft_p50_s"]


def test_a_mixed_workload_escalates_hard_prompts_more_and_is_reproducible() -> None:
    s = summary(run(SMALL))
    assert 0 < s["escalated_fraction"] < 1
    assert s["by_kind"]["hard"]["escalated_fraction"] > s["by_kind"]["easy"]["escalated_fraction"]
    assert 0 < s["cost_saved_fraction"] < 1
    assert summary(run(SMALL)) == s  # a pure function of the scenario and its seed


def test_the_cli_writes_its_summary_and_refuses_bad_options(tmp_path: Path) -> None:
    out, err = StringIO(), StringIO()
    path = tmp_path / "cascade.json"
    assert main(["--requests", "20", "--json", str(path)], out, err) == 0
    assert "saved" in out.getvalue()
    assert json.loads(path.read_text())["requests"] == 20
    assert main(["--hard-share", "2"], out, err) == 2
    assert "--hard-share must be in [0, 1]" in err.getvalue()
