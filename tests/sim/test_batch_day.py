"""The Batch API's day in virtual time: a diurnal day of online traffic on two simulated
workers, and a batch of 1000 requests created at the day's peak, run at priority class
batch. The batch ends within its window, and the online requests meet their SLO within a
point of the same day without it (seed 3: 99.88 % alone, 99.84 % with the batch; the
spread over seeds is in docs/benchmarks.md, "Batch API").

On an elastic pool whose replicas the SLO planner decides, the planner's metrics count the
online classes only: its replicas over the day are the same with the batch as without it,
and more when it counts the batch like online work (the break that test guards)."""

from __future__ import annotations

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
    # Sixteen lines slow the online steps (TPOT p90 16 -> 30 ms, the calm limit): the
    # planner holds the peak's replica a few samples longer, it adds none.
    assert sum(with_batch) - sum(without) <= 4
    assert sum(counted) - sum(without) > 4


def test_the_day_with_four_lines_in_flight_keeps_the_replicas_of_the_day_without() -> None:
    without = planned(DAY.max_in_flight, 3, with_batch=False)
    with_batch = planned(DAY.max_in_flight, 3, with_batch=True)
    assert with_batch.day.batch_done_s is not None
    assert _desired(with_batch) == _desired(without)
