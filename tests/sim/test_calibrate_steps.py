"""The calibration check's real side records its steps, and the step drift reads them.

``run_real`` wraps the engine's runner to note each step's shape (the engine's own
scheduler and a fake runner here; tests/sim/test_calibration.py runs the real model), and
``Calibration.step_drift`` is the median of measured over modelled seconds, minus one.
"""

from __future__ import annotations

import itertools

from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.sim.fit import StepSample
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.proto.step_model import StepShape, StepTiming
from kvflow.sim.calibrate import Calibration, run_real

BS = 4
VOCAB = 1 << 17
TIMING = StepTiming(1e-3, 1e-5, 2e-3, 0.0, 1e-3)


def _engine() -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, block_size=BS
        ),
        num_kv_blocks=256,
        vocab_size=VOCAB,
        eos_token_ids=(0,),
        hash_seed=b"seed",
        enable_prefix_caching=True,
    )
    return Engine(config, FakeRunner(block_size=BS, vocab_size=VOCAB))


def _calibration(steps: list[StepSample]) -> Calibration:
    # The summaries are not read by step_drift.
    return Calibration(None, None, tuple(steps), TIMING)  # type: ignore[arg-type]


def test_real_run_records_every_step_and_gives_the_runner_back() -> None:
    engine = _engine()
    runner = engine.runner
    workload = SharedPrefixWorkload(
        num_groups=2, users_per_group=2, prefix_words=(40,), question_words=8, output_tokens=5
    )
    requests = list(itertools.islice(workload.requests(seed=0, namespace="t"), 6))
    run = run_real(engine, requests, [0.001 * i for i in range(6)], clock="cpu")

    assert engine.runner is runner
    assert sorted(r.request_id for r in run.records) == sorted(r.request_id for r in requests)
    assert all(r.num_output_tokens == 5 for r in run.records)
    # Each request decodes 4 tokens past the one its prefill samples: 24 decode seats.
    assert sum(s.shape.num_decode_seqs for s in run.steps) == 6 * 4
    prompt_tokens = sum(r.num_prompt_tokens - r.num_cached_tokens for r in run.records)
    assert sum(s.shape.num_prefill_tokens for s in run.steps) == prompt_tokens
    assert all(s.seconds >= 0 for s in run.steps)


def test_step_drift_is_the_median_ratio_to_the_model() -> None:
    decode = StepShape(num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=2,
                       num_kv_tokens_read=100)  # fmt: skip
    modelled_s = TIMING.shape_s(decode)
    steps = [StepSample(decode, modelled_s * 1.2)] * 5 + [StepSample(decode, modelled_s * 50)]
    assert abs(_calibration(steps).step_drift - 0.2) < 1e-9  # type: ignore[operator]
    slower = [StepSample(decode, modelled_s * 0.5)] * 3
    assert abs(_calibration(slower).step_drift + 0.5) < 1e-9  # type: ignore[operator]
    assert _calibration([]).step_drift is None
