"""bench/throughput_stats.py: the workloads, the interleaving order of the arms and the
statistics over runs that bench/engine_throughput.py reports."""

from __future__ import annotations

import argparse

import pytest
from throughput_stats import (
    FULL,
    QUICK,
    WorkloadSpec,
    make_workload,
    ratio_spread,
    ratios_of_medians,
    rotated,
    spread,
    summarize_runs,
    token_range,
)

ARMS = ["kvflow", "hf-cb", "hf-static", "hf-serial"]


def test_rotation_puts_every_arm_first_once_per_cycle() -> None:
    orders = [rotated(ARMS, run) for run in range(len(ARMS))]
    assert orders[0] == ARMS
    assert orders[1] == ["hf-cb", "hf-static", "hf-serial", "kvflow"]
    assert [o[0] for o in orders] == ARMS
    assert [o[-1] for o in orders] == ["hf-serial", "kvflow", "hf-cb", "hf-static"]
    for order in orders:
        assert sorted(order) == sorted(ARMS)
    assert rotated(ARMS, len(ARMS)) == ARMS
    assert rotated([], 3) == []


def test_spread_is_median_and_range() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([1.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}
    with pytest.raises(ValueError):
        spread([])


def test_summary_and_ratios_use_medians_not_means() -> None:
    runs = [
        {"kvflow": 200.0, "hf-cb": 100.0},
        {"kvflow": 20.0, "hf-cb": 90.0},  # a burst from another job during kvflow's turn
        {"kvflow": 210.0, "hf-cb": 110.0},
    ]
    summary = summarize_runs(runs)
    assert summary["kvflow"] == {"median": 200.0, "min": 20.0, "max": 210.0}
    assert summary["hf-cb"] == {"median": 100.0, "min": 90.0, "max": 110.0}
    assert ratios_of_medians(summary, "kvflow") == {"hf-cb": 2.0}
    per_run = ratio_spread(runs, "kvflow", "hf-cb")
    assert per_run["min"] == pytest.approx(20 / 90)
    assert per_run["median"] == pytest.approx(210 / 110)
    assert per_run["max"] == pytest.approx(2.0)


def test_an_arm_missing_from_a_run_is_summarized_over_the_others() -> None:
    summary = summarize_runs([{"kvflow": 1.0, "hf-serial": 5.0}, {"kvflow": 3.0}])
    assert summary["hf-serial"] == {"median": 5.0, "min": 5.0, "max": 5.0}
    assert summary["kvflow"]["median"] == 2.0
    assert ratio_spread(
        [{"kvflow": 1.0, "hf-serial": 5.0}, {"kvflow": 3.0}], "kvflow", "hf-serial"
    )["median"] == pytest.approx(0.2)


def test_workload_is_seeded_in_range_and_clear_of_special_tokens() -> None:
    spec = WorkloadSpec(10, (4, 8), (2, 5))
    a = make_workload(spec, vocab=50, seed=1)
    assert a == make_workload(spec, vocab=50, seed=1)
    assert a != make_workload(spec, vocab=50, seed=2)
    assert len(a.prompts) == len(a.output_lens) == 10
    assert all(4 <= len(p) <= 8 for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)
    assert all(3 <= t < 50 for p in a.prompts for t in p)
    assert a.num_output_tokens == sum(a.output_lens)
    assert a.max_request_tokens == max(
        len(p) + n for p, n in zip(a.prompts, a.output_lens, strict=True)
    )


def test_static_useful_fraction_counts_the_padding_to_the_longest_output() -> None:
    w = make_workload(WorkloadSpec(3, (1, 1), (1, 1)), vocab=10, seed=0)
    assert w.static_useful_fraction == 1.0
    w2 = type(w)(prompts=[[3], [3], [3], [3]], output_lens=[10, 10, 2, 2])
    assert w2.static_useful_fraction == pytest.approx(24 / 40)


def test_quick_keeps_the_full_workloads_batch_mix_and_static_waste() -> None:
    """--quick must show what the full workload shows: the same batch of 64 requests, the
    same share of prompt tokens, a static batch wasting as large a part of its output slots
    (the old quick workloads, 16 requests, showed kvflow and transformers' continuous
    batching even where the full one puts kvflow 1.7x ahead)."""
    full = make_workload(FULL, vocab=32000, seed=0)
    quick = make_workload(QUICK, vocab=32000, seed=0)
    assert quick.num_output_tokens < full.num_output_tokens * 0.6
    assert len(quick.prompts) == len(full.prompts)  # the batch decides continuous batching's lead
    quick_prompt_tokens = sum(map(len, quick.prompts))
    full_prompt_tokens = sum(map(len, full.prompts))
    assert quick_prompt_tokens < full_prompt_tokens * 0.6
    prompt_share = quick_prompt_tokens / (quick_prompt_tokens + quick.num_output_tokens)
    full_share = full_prompt_tokens / (full_prompt_tokens + full.num_output_tokens)
    assert abs(prompt_share - full_share) < 0.05
    assert quick.static_useful_fraction < 0.65
    assert abs(quick.static_useful_fraction - full.static_useful_fraction) < 0.15


def test_token_range_parses_lo_hi_and_refuses_what_is_not_one() -> None:
    assert token_range("16,128") == (16, 128)
    assert token_range("8,8") == (8, 8)
    for bad in ("128,16", "0,4", "16", "a,b", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            token_range(bad)
