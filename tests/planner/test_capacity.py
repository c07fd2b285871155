"""A replica's SLO capacity from a step-time profile, against hand arithmetic."""

from __future__ import annotations

import math

import pytest

from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.operator.planner.capacity import (
    capacity_from_timing,
    decode_seqs_within_tpot,
    max_queue_utilization,
    prefill_tokens_per_s,
    prompt_alone_s,
)
from kvflow.operator.planner.forecast import Holt, damped_reach_s, sizing_load, start_or_update
from kvflow.proto.step_model import StepTiming

ROUND = StepTiming(base_step_s=0.005, per_prefill_token_s=50e-6, per_decode_seq_s=50e-6)


def test_decode_seqs_by_tpot_kv_and_batch_limit() -> None:
    # (25 ms - 5 ms) / 50 us = 400 sequences within a 25 ms TPOT.
    kw = {"context_tokens": 1000.0, "tpot_target_s": 0.025}
    assert decode_seqs_within_tpot(ROUND, max_num_seqs=1000, kv_capacity_tokens=10**9, **kw) == 400
    assert decode_seqs_within_tpot(ROUND, max_num_seqs=256, kv_capacity_tokens=10**9, **kw) == 256
    # 150 k KV tokens / 1,000 per sequence = 150.
    assert (
        decode_seqs_within_tpot(ROUND, max_num_seqs=1000, kv_capacity_tokens=150_000, **kw) == 150
    )
    # KV reads: 1 ns per token x 1,000 tokens = 1 us more per sequence: 20 ms / 51 us = 392.
    with_kv = StepTiming(0.005, 50e-6, 50e-6, per_kv_token_s=1e-9)
    assert (
        decode_seqs_within_tpot(with_kv, max_num_seqs=1000, kv_capacity_tokens=10**9, **kw) == 392
    )


def test_prefill_throughput_alone_and_queue() -> None:
    # A 2,000-token chunk: 5 ms + 2,000 x 50 us = 105 ms -> 19,048 tokens/s.
    assert prefill_tokens_per_s(ROUND, input_tokens=1000, chunk_tokens=2000) == pytest.approx(
        2000 / 0.105
    )
    # A 3,000-token prompt in 2,000-token chunks: 2 steps x 5 ms + 3,000 x 50 us = 160 ms.
    assert prompt_alone_s(ROUND, input_tokens=3000, chunk_tokens=2000) == pytest.approx(0.160)
    # rho with P(wait > 0.1 s) = 10 % at 50 ms service: rho exp(-2 (1 - rho) 2 / rho) = 0.1.
    rho = max_queue_utilization(service_s=0.05, wait_budget_s=0.1, tail=0.1)
    assert rho * math.exp(-2 * (1 - rho) * 2 / rho) == pytest.approx(0.1, rel=1e-9)
    assert 0.5 < rho < 0.95
    # A loose budget hits the 95 % cap.
    assert max_queue_utilization(service_s=0.05, wait_budget_s=10, tail=0.1) == 0.95


def test_capacity_of_a_shipped_simulator_profile() -> None:
    # docs/planner.md's worked example: h100-llama3-8b, 1,024-in / 256-out, TTFT 1 s and
    # TPOT 50 ms at p90.
    profile = named_profile("h100-llama3-8b")
    assert profile is not None
    t = profile.timing
    cost = StepTiming(
        t.base_step_s,
        t.per_prefill_token_s,
        t.per_decode_seq_s,
        t.per_kv_token_s,
        t.per_prefill_seq_s,
    )
    cap = capacity_from_timing(
        cost,
        mean_input_tokens=1024,
        mean_output_tokens=256,
        ttft_target_s=1.0,
        tpot_target_s=0.05,
        percentile=90,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_num_seqs=profile.max_num_seqs,
        kv_capacity_tokens=profile.num_kv_blocks * profile.block_size,
        source="h100-llama3-8b",
    )
    # 8,192 / (6.6 ms + 8,192 x (27.1 us + 48.9 ns)) = 35.8 k tokens/s, x 0.95 = 34.0 k.
    assert cap.max_prompt_tokens_per_s == pytest.approx(33_979, rel=1e-3)
    # (50 - 6.6) ms / (30.3 us + 1,152 x 48.9 ns) = 501 -> max_num_seqs 256, whose step is
    # 6.6 ms + 256 x 86.6 us = 28.8 ms: 8.9 k output tokens/s.
    assert cap.max_decode_tokens_per_s == pytest.approx(256 / 0.028780, rel=1e-4)


def test_impossible_targets_say_what_to_change() -> None:
    kw = {
        "mean_input_tokens": 1000.0,
        "mean_output_tokens": 100.0,
        "percentile": 90.0,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
        "kv_capacity_tokens": 10**6,
    }
    with pytest.raises(ValueError, match=r"over the TPOT target.*raise tpotTargetMs"):
        capacity_from_timing(ROUND, ttft_target_s=1.0, tpot_target_s=0.004, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"alone takes 55 ms.*raise ttftTargetMs"):
        capacity_from_timing(ROUND, ttft_target_s=0.05, tpot_target_s=0.1, **kw)  # type: ignore[arg-type]


def test_holt_follows_a_ramp_and_ignores_stale_samples() -> None:
    holt = None
    for i in range(20):  # +100 per 10 s
        holt = start_or_update(holt, 1000 + 100 * i, 10.0 * i, alpha=0.5, beta=0.3)
    assert holt is not None
    assert holt.trend_per_s == pytest.approx(10.0, rel=0.02)
    assert holt.forecast(30) == pytest.approx(2900 + 300, rel=0.02)
    assert holt.update(5.0, holt.time_s, alpha=0.5, beta=0.3) is holt


def test_sizing_load_caps_a_noisy_forecast() -> None:
    steep = Holt(100.0, 50.0, 0.0, last_value=100.0, slopes_per_s=(50.0,) * 5)
    assert sizing_load(100.0, steep, 60.0, max_growth=2.0, sample_window_s=30) == 200.0  # not 3,100
    dipping = Holt(100.0, -5.0, 0.0, last_value=100.0, slopes_per_s=(-5.0, 1.0, -5.0, -5.0, -5.0))
    assert sizing_load(100.0, dipping, 60.0, max_growth=2.0, sample_window_s=30) == 100.0


def test_a_decline_is_sized_at_this_moment() -> None:
    # Five falls in a row: a sample is the rate over the last 30 s, the load of 15 s ago;
    # the load now is 15 s of the gentler slope (Holt's -1/s, not the median -2/s) lower.
    falling = Holt(100.0, -1.0, 0.0, last_value=100.0, slopes_per_s=(-2.0, -3.0, -2.0, -1.0, -2.0))
    assert falling.is_falling
    assert sizing_load(100.0, falling, 90.0, max_growth=2.0, sample_window_s=30) == 85.0
    assert falling.present(30) == 85.0
    # A decline steeper than the load ends at zero, not below.
    assert Holt(10.0, -5.0, 0.0, last_value=10.0, slopes_per_s=(-5.0,) * 5).present(30) == 0.0
    # A rise is not extrapolated; nor is anything before there are five slopes.
    assert Holt(100.0, 1.0, 0.0, last_value=100.0, slopes_per_s=(1.0,) * 5).present(30) == 100.0
    assert Holt(100.0, -1.0, 0.0, last_value=100.0, slopes_per_s=(-1.0,) * 4).present(30) == 100.0
    # Falls that are not five in a row are extrapolated by `present`, but not sized for.
    dipping = Holt(100.0, -1.0, 0.0, last_value=100.0, slopes_per_s=(-1.0, 1.0, -1.0, -1.0, -1.0))
    assert not dipping.is_falling and dipping.present(30) == 85.0
    assert sizing_load(100.0, dipping, 90.0, max_growth=2.0, sample_window_s=30) == 100.0


def test_a_damped_trend_reaches_less_far_the_further_it_looks() -> None:
    assert damped_reach_s(1.0, 60.0) == pytest.approx(1.0, rel=0.01)  # short: the horizon
    assert damped_reach_s(90.0, 60.0) == pytest.approx(46.6, abs=0.1)  # 60 (1 - e^-1.5)
    assert damped_reach_s(3600.0, 60.0) == pytest.approx(60.0)  # never more than 60 s
    ramp = Holt(100.0, 1.0, 0.0, last_value=100.0, slopes_per_s=(1.0,) * 5)
    assert ramp.forecast(90.0) == 190.0
    assert ramp.forecast(90.0, damping_s=60.0) == pytest.approx(146.6, abs=0.1)
    with pytest.raises(ValueError, match="damping_s must be > 0"):
        damped_reach_s(90.0, 0.0)


def test_a_jump_is_no_slope_but_a_ramp_is() -> None:
    holt = None
    for i, value in enumerate([10.0, 10.0, 10.0, 10.0, 10.0, 30.0, 31.0]):  # a step, noise
        holt = start_or_update(holt, value, 30.0 * i, alpha=0.5, beta=0.3)
    assert holt is not None and holt.trend_per_s > 0.1  # Holt's own trend: 0.2/s
    assert holt.forecast(90.0) == 31.0  # the median slope is 0: no echo of the jump
    for i in range(7, 12):  # then a ramp, +3 per 30 s
        holt = start_or_update(holt, 31.0 + 3 * (i - 6), 30.0 * i, alpha=0.5, beta=0.3)
    assert holt.forecast(90.0) > 46.0 + 3.0


def test_a_colocated_replica_pays_the_base_step_once() -> None:
    """Prompt and decode shares of a colocated replica add to its busy time per second.

    Its prompts' chunks ride in the steps it runs for decode, so the base step is in the
    decode share only (n / step(n) counts one base per step); counting it in the prompt
    share too overstated the load (issue 9's doubt: 3.85 shares where 3.73 is right).
    """
    cost = StepTiming(0.02, per_prefill_token_s=100e-6, per_decode_seq_s=200e-6,
                    per_kv_token_s=1e-8, per_prefill_seq_s=1e-3)  # fmt: skip
    kw = {
        "mean_input_tokens": 250.0,
        "mean_output_tokens": 50.0,
        "ttft_target_s": 5.0,  # loose: rho is the 0.95 cap
        "tpot_target_s": 0.06,
        "percentile": 90.0,
        "max_num_batched_tokens": 2000,
        "max_num_seqs": 32,
        "kv_capacity_tokens": 10**6,
    }
    apart = capacity_from_timing(cost, **kw)  # type: ignore[arg-type]
    joint = capacity_from_timing(cost, colocated=True, **kw)  # type: ignore[arg-type]
    assert joint.max_decode_tokens_per_s == apart.max_decode_tokens_per_s
    # Per prompt token: 100 us + 10 ns KV + 1 ms / 250 tokens per prompt = 104.01 us.
    assert joint.max_prompt_tokens_per_s == pytest.approx(0.95 / 104.01e-6, rel=1e-9)
    # A disaggregated prefill replica's chunk of 2,000 tokens (8 prompts) pays the base:
    # 20 ms + 2,000 x 100.01 us + 8 x 1 ms = 228.02 ms.
    assert apart.max_prompt_tokens_per_s == pytest.approx(0.95 * 2000 / 0.22802, rel=1e-9)
    # 20 requests/s: 5,000 prompt and 1,000 output tokens/s. Busy seconds per second, at
    # full decode batches of 32 (context 275: 200 us + 275 x 10 ns per sequence):
    # 1,000 / 32 steps x 20 ms base + 1,000 x 202.75 us + 5,000 x 104.01 us.
    prompt, output = 5000.0, 1000.0
    busy = output / 32 * 0.02 + output * 202.75e-6 + prompt * 104.01e-6
    shares = prompt / joint.max_prompt_tokens_per_s + output / joint.max_decode_tokens_per_s
    # The prompt share carries the queue's margin (rho 0.95) and nothing else.
    assert shares == pytest.approx(busy + prompt * 104.01e-6 * (1 / 0.95 - 1), rel=1e-9)
    apart_shares = prompt / apart.max_prompt_tokens_per_s + output / apart.max_decode_tokens_per_s
    # Counted apart, each prompt token also paid its chunk's share of a base step (and of
    # the per-prompt cost at 8 prompts per chunk): 20 ms / 2,000 = 10 us more per token.
    extra_per_token_s = 0.22802 / 2000 - 104.01e-6
    assert apart_shares - shares == pytest.approx(prompt * extra_per_token_s / 0.95, rel=1e-6)
