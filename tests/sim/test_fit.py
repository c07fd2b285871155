"""Least squares recovers a known step model, and never keeps a negative coefficient."""

from __future__ import annotations

import random

import pytest

from kvflow.engine_worker.sim.fit import StepSample, fit_timing
from kvflow.engine_worker.sim.timing import StepShape, StepTiming

TRUE = StepTiming(base_step_s=0.02, per_prefill_token_s=3e-4, per_decode_seq_s=2e-3,
                  per_kv_token_s=4e-6, per_prefill_seq_s=1e-3)  # fmt: skip


def samples(noise: float, timing: StepTiming = TRUE, n: int = 400) -> list[StepSample]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        prefill_seqs = rng.randrange(0, 3)
        shape = StepShape(
            num_prefill_tokens=rng.randrange(1, 512) if prefill_seqs else 0,
            num_prefill_seqs=prefill_seqs,
            num_decode_seqs=rng.randrange(0, 33),
            num_kv_tokens_read=rng.randrange(0, 20_000),
        )
        out.append(StepSample(shape, timing.shape_s(shape) * (1 + rng.gauss(0, noise))))
    return out


def test_recovers_the_model_from_noisy_steps() -> None:
    fit = fit_timing(samples(noise=0.005))
    for name in TRUE.__dataclass_fields__:
        assert getattr(fit.timing, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    assert fit.r_squared > 0.99
    assert fit.median_abs_error_fraction < 0.03


def test_a_cost_the_steps_do_not_have_is_zero_not_negative() -> None:
    free_kv = StepTiming(base_step_s=0.01, per_prefill_token_s=2e-4, per_decode_seq_s=1e-3)
    fit = fit_timing(samples(noise=0.05, timing=free_kv))
    assert all(getattr(fit.timing, f) >= 0 for f in free_kv.__dataclass_fields__)
    assert fit.timing.per_kv_token_s < 1e-7
    assert fit.timing.per_prefill_token_s == pytest.approx(2e-4, rel=0.05)


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 5 measured steps"):
        fit_timing(samples(0.0, n=3))
