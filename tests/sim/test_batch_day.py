"""The Batch API's day in virtual time: a diurnal day of online traffic on two simulated
workers, and a batch of 1000 requests created at the day's peak. The batch ends within its
window, and the online requests meet their SLO within a point of the same day without it
(seed 3: 99.9 % alone, 99.1 % with the batch; starting lines without looking for spare
capacity, 97.9 %)."""

from __future__ import annotations

from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.records import RequestRecord
from kvflow.proto.step_model import StepTiming
from kvflow.sim.autoscale import Slo
from kvflow.sim.autoscale_traffic import Traffic
from kvflow.sim.batch_day import BatchDay, run_day
from kvflow.sim.cluster import ClusterSpec

TIMING = StepTiming(base_step_s=0.010, per_prefill_token_s=0.0002, per_decode_seq_s=0.001)
PROFILE = SimProfile(name="batch-day", timing=TIMING, block_size=16,
                     kv_bytes_per_block=16 * 1024, num_kv_blocks=4096,
                     max_num_batched_tokens=2048, max_num_seqs=16, kv_link_bytes_per_s=1.6e6,
                     source="test")  # fmt: skip
DAY_S = 300.0  # a day, compressed; the batch's "24h" is the same span
# At the peak the two workers are busy (queues form now and then) but within the SLO.
TRAFFIC = Traffic("diurnal", DAY_S, 14.0, input_tokens=(128, 384), output_tokens=(16, 64))
DAY = BatchDay(TRAFFIC, num_lines=1000, submitted_at_s=DAY_S / 2, window_s=DAY_S,
               max_in_flight=4, input_tokens=256, output_tokens=32)  # fmt: skip
SLO = Slo(ttft_s=0.5, tpot_s=0.05)


def _p90_ttft(records: list[RequestRecord]) -> float:
    values = sorted(r.ttft_s for r in records if r.ttft_s is not None)
    return values[int(0.9 * (len(values) - 1))]


def _attainment(records: list[RequestRecord]) -> float:
    return sum(1 for r in records if r.error is None and SLO.is_met(r)) / len(records)


def test_a_batch_at_the_peak_ends_in_its_window_and_leaves_the_online_slo_alone() -> None:
    spec = ClusterSpec(PROFILE, num_workers=2)
    alone = run_day(spec, DAY, with_batch=False, seed=3)
    shared = run_day(spec, DAY, with_batch=True, seed=3)
    assert [r.request_id for r in shared.online] == [r.request_id for r in alone.online]
    assert len(shared.batch) == DAY.num_lines
    assert all(r.error is None for r in shared.batch)
    assert shared.batch_done_s is not None
    assert shared.batch_done_s <= DAY.submitted_at_s + DAY.window_s
    assert shared.most_in_flight == DAY.max_in_flight
    assert _attainment(alone.online) > 0.99
    assert _attainment(shared.online) >= _attainment(alone.online) - 0.01
    # Four batch lines at most beside the online ones: their first tokens barely move.
    assert _p90_ttft(shared.online) <= 1.15 * _p90_ttft(alone.online)
