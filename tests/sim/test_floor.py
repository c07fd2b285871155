"""The TTFT floor (kvflow.sim.floor): no router gives a request a TTFT under its floor."""

from __future__ import annotations

import pytest

from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.ladder import open_loop_schedule
from kvflow.loadgen.metrics import Slo, is_measured, percentile
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.proto.step_model import StepTiming
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec, VirtualCluster
from kvflow.sim.floor import TtftFloor, prefill_floor_s
from kvflow.sim.ladders import SimLadder, run_ladder

TIMING = StepTiming(1e-3, 1e-6, 0.0, 0.0, per_prefill_seq_s=1e-4)


def test_a_prompt_prefills_in_whole_steps_of_at_most_the_step_budget() -> None:
    assert prefill_floor_s(TIMING, 10_000, 8192) == pytest.approx(2 * 1.1e-3 + 10_000e-6)
    assert prefill_floor_s(TIMING, 8192, 8192) == pytest.approx(1.1e-3 + 8192e-6)
    assert prefill_floor_s(TIMING, 0, 8192) == pytest.approx(1.1e-3 + 1e-6)  # the last token


def _tokens(*blocks: str, tail: int = 0) -> list[int]:
    """16 tokens a named block (each its name's code), then ``tail`` more of another."""
    return [t for name in blocks for t in [ord(name)] * 16] + [0] * tail


def test_only_blocks_an_earlier_prompt_had_are_free_and_never_the_last_token() -> None:
    floor = TtftFloor(TIMING, 8192, block_size=16)
    first = floor.add("a", _tokens("p", "q", "r"), arrival_s=0.0)
    assert first == pytest.approx(prefill_floor_s(TIMING, 48, 8192))
    # Long after: shares the first two blocks, then differs: 32 free tokens.
    assert floor.add("b", _tokens("p", "q", "x"), arrival_s=1.0) == pytest.approx(
        prefill_floor_s(TIMING, 16, 8192)
    )
    # The same prompt again: its last block holds the last token, computed anyway.
    assert floor.add("c", _tokens("p", "q", "r"), arrival_s=2.0) == pytest.approx(
        prefill_floor_s(TIMING, 16, 8192)
    )
    # Two shared blocks and a partial one: only the partial block's 8 tokens to compute.
    assert floor.add("d", _tokens("p", "q", tail=8), arrival_s=3.0) == pytest.approx(
        prefill_floor_s(TIMING, 8, 8192)
    )
    # A block is known with its prefix: "q" after "z" is not "q" after "p".
    assert floor.add("e", _tokens("z", "q", "r", "s"), arrival_s=4.0) == pytest.approx(
        prefill_floor_s(TIMING, 64, 8192)
    )
    assert floor.p90_s(["a", "b"]) == pytest.approx(
        percentile(sorted([first, floor.floor_s["b"]]), 0.9)
    )
    assert floor.p90_s([]) is None


def test_a_prefix_still_being_prefilled_is_waited_for_or_computed_again() -> None:
    """A follower that arrives while its prefix is being prefilled can use it only once
    it exists (1 us a token here): its floor is the lesser of waiting and computing."""
    floor = TtftFloor(TIMING, 8192, block_size=16)
    floor.add("leader", _tokens(*"abcdefgh", tail=4), arrival_s=0.0)  # 128 + 4 tokens
    # 8 us later: the leader's 6th block exists no earlier than 96 us after it arrived.
    follower = floor.add("follower", _tokens(*"abcdef", tail=4), arrival_s=8e-6)
    waited = (96e-6 - 8e-6) + prefill_floor_s(TIMING, 4, 8192)
    assert follower == pytest.approx(min(waited, prefill_floor_s(TIMING, 100, 8192)))
    assert follower > prefill_floor_s(TIMING, 4, 8192)  # not the bare hit
    # Blocks the follower did not add become no readier: a later prompt of the leader's
    # 8 blocks waits for the leader's 8th (128 us), not less.
    late = floor.add("late", _tokens(*"abcdefgh", tail=2), arrival_s=100e-6)
    assert late == pytest.approx((128e-6 - 100e-6) + prefill_floor_s(TIMING, 2, 8192))


@pytest.mark.parametrize("arm", ["kvflow", "round-robin", "least-loaded"])
def test_no_request_of_a_real_run_starts_before_its_floor(arm: str) -> None:
    """On a real virtual cluster, past saturation and with shared prefixes: every request's
    TTFT is at least its floor, under a prefix-aware router and two blind ones. (Not the
    ideal arm: its oracle counts a block as a hit from its first request's arrival, before
    any worker has computed it, which no real cache does.)"""
    profile = named_profile("h100-llama3-8b")
    assert profile is not None
    spec = ClusterSpec(profile, num_workers=2, num_kv_blocks=256)
    ladder = SimLadder("shared-prefix", SharedPrefixWorkload(6, 4, (1024,), 128, 8),
                       [LoadPoint(ArrivalKind.POISSON, 60.0)], Slo(ttft_s=0.2, tpot_s=0.1),
                       seed=1, warmup_requests=20, measured_requests=80)  # fmt: skip
    point = ladder.points[0]
    schedule = open_loop_schedule(ladder.plan_for(point), point, 0)
    cluster = VirtualCluster(spec, resolve_arm(arm), seed=ladder.seed)
    for request, offset_s in zip(schedule.requests, schedule.offsets_s, strict=True):
        cluster.submit(request, offset_s)
    records = cluster.run()
    assert len(records) == len(cluster.floor.floor_s) >= 90
    for record in records:
        floor_s = cluster.floor.floor_s[record.request_id]
        assert record.ttft_s is not None and record.ttft_s >= floor_s - 1e-9, (record, floor_s)
    # Not trivially small: misses prefill 1,152 tokens (38 ms), hits their question.
    assert max(cluster.floor.floor_s.values()) > 0.03
    assert min(cluster.floor.floor_s.values()) < 0.015

    (result,) = run_ladder(spec, resolve_arm(arm), ladder)
    measured = [r.request_id for r in result.records if is_measured(r, 20 / 60.0)]
    assert result.floor_ttft_p90_s == pytest.approx(cluster.floor.p90_s(measured))
    assert result.summary.latency.ttft_s.p90 is not None
    assert result.summary.latency.ttft_s.p90 >= result.floor_ttft_p90_s
