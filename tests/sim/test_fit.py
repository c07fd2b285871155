"""Least squares recovers a known step model, and never keeps a negative coefficient."""

from __future__ import annotations

import random

import pytest

from kvflow.engine_worker.sim.fit import StepSample, fit_timing
from kvflow.proto.step_model import StepShape, StepTiming

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


def test_a_dropped_cost_is_refitted_not_just_clipped() -> None:
    # Steps that get slightly faster with more KV read (nonphysical, as noise can make a
    # real sweep look): that coefficient must go to 0 and the others absorb its share, so
    # the profile still predicts the steps (clipping it alone would leave decode 6 % high).
    rng = random.Random(0)
    data = []
    for _ in range(400):
        decode, prefill = rng.randrange(1, 33), rng.randrange(0, 300)
        shape = StepShape(prefill, 1 if prefill else 0, decode, decode * rng.randrange(200, 400))
        seconds = 0.01 + 2e-4 * prefill + 1e-3 * decode - 2e-7 * shape.num_kv_tokens_read
        data.append(StepSample(shape, seconds))
    fit = fit_timing(data)
    assert fit.timing.per_kv_token_s == 0.0
    errors = sorted(abs(fit.timing.shape_s(s.shape) - s.seconds) / s.seconds for s in data)
    assert errors[len(errors) // 2] < 0.01
    assert fit.median_abs_error_fraction == pytest.approx(errors[len(errors) // 2])


def test_short_steps_are_fitted_as_closely_as_long_ones() -> None:
    # A serving run is mostly short decode steps; a sweep also has long prefills that the
    # linear model cannot fit exactly (attention's square term). Relative errors keep the
    # decode steps right; absolute ones let the long prefills bend the base step.
    rng = random.Random(1)
    data = []
    for _ in range(300):
        decode = rng.randrange(1, 17)
        data.append(StepSample(StepShape(0, 0, decode, 0), 0.02 + 0.002 * decode))
    for _ in range(60):
        prefill = rng.randrange(500, 4000)
        seconds = 0.02 + 2e-4 * prefill + 2e-7 * prefill**2
        data.append(StepSample(StepShape(prefill, 1, 0, 0), seconds))
    fit = fit_timing(data)
    decode_errors = sorted(abs(fit.timing.shape_s(s.shape) - s.seconds) / s.seconds
                           for s in data[:300])  # fmt: skip
    assert decode_errors[150] < 0.05


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 5 measured steps"):
        fit_timing(samples(0.0, n=3))
