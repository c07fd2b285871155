"""The Batch API's day in virtual time: a diurnal day of online traffic on two simulated
workers, and a batch of 1000 requests created at the day's peak, run at priority class
batch. The batch ends within its window, and the online requests meet their SLO as on the
same day without it (seed 3: 99.88 % alone, 99.92 % with the batch; the spread over seeds
is in docs/benchmarks.md, "Batch API"). The runner starts a line only while every
worker's decode step with it stays within 0.3 of the online TPOT target
(kvflow.router.batch.pacing); waiting for queues alone, the batch's steps push online
requests past their TPOT target (seed 4: five more misses).

On an elastic pool whose replicas the SLO planner decides, the planner's metrics count the
online classes only: its replicas over the day are the same with the batch as without it,
and more when it counts the batch like online work (the break that test guards)."""

from __future__ import annotations

import dataclasses
import io

import pytest

from kvflow.cli import sim as sim_cli
from kvflow.loadgen.records import RequestRecord
from kvflow.sim.batch_day import PlannedDay, run_day
from kvflow.sim.batch_day_cli import DAY, NUM_WORKERS, PROFILE, attainment, planned, planner_arms
from kvflow.sim.cluster import ClusterSpec


def _p90_ttft(records: list[RequestRecord]) -> float:
    values = sorted(r.ttft_s for r in records if r.ttft_s is not None)
    return values[int(0.9 * (len(values) - 1))]


def test_a_batch_at_the_peak_ends_in_its_window_and_leaves_the_online_slo_alone() -> None:
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    alone = run_day(spec, DAY, with_batch=False, seed=3)
    shared = run_day(spec, DAY, with_batch=True, seed=3)
    assert [r.request_id for r in shared.online] == [r.request_id for r in alone.online]
    assert len(shared.batch) == DAY.num_lines
    assert all(r.error is None for r in shared.batch)
    assert shared.batch_done_s is not None
    assert shared.batch_done_s <= DAY.submitted_at_s + DAY.window_s
    assert shared.most_in_flight == DAY.max_in_flight
    assert attainment(alone.online) > 0.99
    assert attainment(shared.online) >= attainment(alone.online) - 0.01
    # Four batch lines at most beside the online ones: their first tokens barely move.
    assert _p90_ttft(shared.online) <= 1.15 * _p90_ttft(alone.online)


def test_the_batch_leaves_the_online_tpot_alone_where_waiting_for_queues_did_not() -> None:
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    alone = run_day(spec, DAY, with_batch=False, seed=4)
    paced = run_day(spec, DAY, with_batch=True, seed=4)
    queues_only = run_day(spec, dataclasses.replace(DAY, tpot_headroom=None), with_batch=True,
                          seed=4)  # fmt: skip
    assert paced.batch_done_s is not None
    assert paced.batch_done_s <= DAY.submitted_at_s + DAY.window_s
    assert attainment(paced.online) >= attainment(alone.online)
    # The break this guards: without the headroom, batch decodes lengthen the online steps.
    assert attainment(queues_only.online) < attainment(alone.online)
    # Paced, the batch yields steps to online work: it ends later than unpaced.
    assert queues_only.batch_done_s is not None
    assert paced.batch_done_s > queues_only.batch_done_s


def _desired(day: PlannedDay) -> list[int]:
    return [s.desired for s in day.replicas]


def test_the_planner_adds_no_replica_for_the_batch() -> None:
    # Sixteen lines in flight: a batch heavy enough that a planner counting it scales up.
    arms = planner_arms(max_in_flight=16, seed=3)
    assert arms.with_batch.day.batch_done_s is not None
    assert arms.with_batch.day.batch_done_s <= DAY.submitted_at_s + DAY.window_s
    without, with_batch = _desired(arms.without), _desired(arms.with_batch)
    counted = _desired(arms.batch_counted)
    assert max(without) > NUM_WORKERS  # the online peak alone asks for a replica
    assert max(with_batch) == max(without)
    assert max(counted) > max(without)
    # Paced by the online TPOT headroom, sixteen lines leave the replicas as they are.
    # (Waiting for queues only, they raised the online TPOT p90 from 16 to 30 ms, the calm
    # limit, and the planner held the peak's replica a few samples longer.)
    assert with_batch == without
    assert sum(counted) - sum(without) > 4


def test_the_day_with_four_lines_in_flight_keeps_the_replicas_of_the_day_without() -> None:
    without = planned(DAY.max_in_flight, 3, with_batch=False)
    with_batch = planned(DAY.max_in_flight, 3, with_batch=True)
    assert with_batch.day.batch_done_s is not None
    assert _desired(with_batch) == _desired(without)


def test_kvflow_sim_batch_day_is_the_command_and_refuses_bad_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as help_exit:
        sim_cli.main(["batch-day", "--help"], out, err)
    assert help_exit.value.code == 0
    assert "usage: kvflow sim batch-day" in capsys.readouterr().out
    assert sim_cli.main(["batch-day", "--tpot-headroom-fraction", "1.5"], out, err) == 2
    assert "--tpot-headroom-fraction" in err.getvalue()
    assert sim_cli.main(["batch-day", "--seeds", "1"], out, err) == 2
