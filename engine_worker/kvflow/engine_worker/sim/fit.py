"""Fit a step-time model to measured steps: least squares, every coefficient >= 0.

Columns: 1, prefill tokens, decode sequences, KV tokens read, prefill sequences (the
terms of ``StepTiming``). Errors are relative: each step's row is divided by its measured
time, so a 20 ms decode step counts as much as a 2 s prefill (plain least squares lets
the long steps of a sweep decide, and the short ones, most of a serving run's steps, end
up 15-20 % off). A coefficient that comes out negative has no physical meaning (a token
cannot make a step faster); it is fixed at 0 and the rest refitted, repeatedly, which is
the active-set answer for five columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvflow.proto.step_model import StepShape, StepTiming

COLUMNS = (
    "base_step_s",
    "per_prefill_token_s",
    "per_decode_seq_s",
    "per_kv_token_s",
    "per_prefill_seq_s",
)


@dataclass(frozen=True, slots=True)
class StepSample:
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class Fit:
    timing: StepTiming
    num_samples: int
    r_squared: float
    median_abs_error_fraction: float  # |predicted - measured| / measured, median over steps


def _row(shape: StepShape) -> list[float]:
    return [
        1.0,
        float(shape.num_prefill_tokens),
        float(shape.num_decode_seqs),
        float(shape.num_kv_tokens_read),
        float(shape.num_prefill_seqs),
    ]


def fit_timing(samples: Sequence[StepSample]) -> Fit:
    if len(samples) < len(COLUMNS):
        raise ValueError(f"need at least {len(COLUMNS)} measured steps, got {len(samples)}")
    if min(s.seconds for s in samples) <= 0:
        raise ValueError("every measured step must take more than 0 s")
    x = np.array([_row(s.shape) for s in samples])
    y = np.array([s.seconds for s in samples])
    xw, yw = x / y[:, None], np.ones_like(y)  # relative errors
    active = list(range(len(COLUMNS)))
    coef = np.zeros(len(COLUMNS))
    while active:
        solution, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        coef[:] = 0.0
        coef[active] = solution
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
        coef[:] = 0.0
    coef = np.maximum(coef, 0.0)  # float noise around an exact zero
    timing = StepTiming(**{name: float(c) for name, c in zip(COLUMNS, coef, strict=True)})
    predicted = x @ coef  # what the returned timing predicts
    residual = float(np.sum((y - predicted) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    errors = sorted(abs(p - m) / m for p, m in zip(predicted, y, strict=True) if m > 0)
    return Fit(
        timing=timing,
        num_samples=len(samples),
        r_squared=1.0 - residual / total if total > 0 else math.nan,
        median_abs_error_fraction=errors[len(errors) // 2] if errors else math.nan,
    )
