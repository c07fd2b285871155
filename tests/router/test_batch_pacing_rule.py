"""The rule a batch line starts by (kvflow.router.batch.pacing), shared by the router's
runner and the simulator's batch day: no worker has requests waiting and, with an online
TPOT target, every worker's decode step with one more sequence, priced by the shared step
model, stays within the headroom share of it. And the flags that set it."""

from __future__ import annotations

import argparse

import pytest

from kvflow.proto.step_model import StepTiming
from kvflow.router.batch.config import add_batch_flags, batch_config
from kvflow.router.batch.pacing import (
    DEFAULT_TPOT_HEADROOM_FRACTION,
    TpotHeadroom,
    WorkerLoad,
    decode_step_with_line_s,
    may_start_line,
)

# The batch day's profile (kvflow.sim.batch_day_cli): 10 ms a step, 1 ms a decoding sequence.
TIMING = StepTiming(base_step_s=0.010, per_prefill_token_s=0.0002, per_decode_seq_s=0.001)
# 50 ms TPOT, 0.4 of it: a decode step of at most 20 ms with the line, 9 sequences besides.
HEADROOM = TpotHeadroom(0.050, 0.4)


def test_a_queue_anywhere_holds_the_line_with_or_without_a_target() -> None:
    workers = [WorkerLoad(0), WorkerLoad(1)]
    assert not may_start_line(workers, TIMING, 256, None)
    assert not may_start_line(workers, TIMING, 256, HEADROOM)
    assert may_start_line([WorkerLoad(0), WorkerLoad(0)], TIMING, 256, None)


def test_without_a_target_only_queues_hold_the_line() -> None:
    assert may_start_line([WorkerLoad(0, num_decode_seqs=500)], TIMING, 256, None)


def test_the_line_starts_while_every_decode_step_with_it_stays_within_the_headroom() -> None:
    calm = WorkerLoad(0, num_decode_seqs=9)
    assert decode_step_with_line_s(TIMING, calm, 256) == pytest.approx(0.020)
    assert may_start_line([calm, WorkerLoad(0)], TIMING, 256, HEADROOM)
    busy = WorkerLoad(0, num_decode_seqs=10)  # 21 ms with the line: over 20
    assert not may_start_line([calm, busy], TIMING, 256, HEADROOM)
    assert not may_start_line([busy, calm], TIMING, 256, HEADROOM)


def test_the_kv_the_line_and_the_decodes_read_count() -> None:
    timing = StepTiming(base_step_s=0.010, per_decode_seq_s=0.001, per_kv_token_s=1e-6)
    # 10 ms + 1 ms x 5 + 1 us x (4,000 + 1,000) = 20 ms: just within.
    worker = WorkerLoad(0, num_decode_seqs=4, num_kv_tokens=4_000)
    assert may_start_line([worker], timing, 1_000, HEADROOM)
    assert not may_start_line([worker], timing, 1_001, HEADROOM)
    heavier = WorkerLoad(0, num_decode_seqs=4, num_kv_tokens=4_001)
    assert not may_start_line([heavier], timing, 1_000, HEADROOM)


@pytest.mark.parametrize(("target_s", "fraction"), [(0.0, 0.4), (-1.0, 0.4), (0.05, 0.0),
                                                    (0.05, 1.5)])  # fmt: skip
def test_a_headroom_outside_its_range_is_refused(target_s: float, fraction: float) -> None:
    with pytest.raises(ValueError):
        TpotHeadroom(target_s, fraction)


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_batch_flags(p)
    return p.parse_args(argv)


def test_the_flags_set_the_headroom_and_no_target_leaves_it_off() -> None:
    assert batch_config(_parse()).tpot_headroom is None
    config = batch_config(_parse("--batch-online-tpot-target-s", "0.05"))
    assert config.tpot_headroom == TpotHeadroom(0.05, DEFAULT_TPOT_HEADROOM_FRACTION)
    config = batch_config(_parse("--batch-online-tpot-target-s", "0.05",
                                 "--batch-tpot-headroom-fraction", "0.25"))  # fmt: skip
    assert config.tpot_headroom == TpotHeadroom(0.05, 0.25)


BAD_FLAGS = [("--batch-tpot-headroom-fraction", "0"), ("--batch-tpot-headroom-fraction", "1.2"),
             ("--batch-tpot-headroom-fraction", "nan"),
             ("--batch-online-tpot-target-s", "-0.05")]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), BAD_FLAGS)
def test_bad_flag_values_are_refused(flag: str, value: str) -> None:
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        _parse(flag, value)
