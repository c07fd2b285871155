"""bench/linear_dtype.py's pass: every product of the shapes in both dtypes, the warm-up
round left out, the ratio from the medians. Never speed: a benchmark is not a test."""

from __future__ import annotations

import linear_dtype
import pytest
import torch.nn.functional as F


def test_a_pass_multiplies_every_shape_in_both_dtypes_and_times_each_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    original = F.linear

    def linear(x, w):  # type: ignore[no-untyped-def]
        calls.append((str(w.dtype), tuple(x.shape), tuple(w.shape)))
        return original(x, w)

    monkeypatch.setattr(linear_dtype.F, "linear", linear)
    shapes = [(8, 4), (3, 8)]
    r = linear_dtype.measure(shapes, rows=2, rounds=3)
    assert len(calls) == 2 * len(shapes) * 4  # 2 dtypes, 3 timed rounds and the warm one
    assert {c[0] for c in calls} == {"torch.float32", "torch.bfloat16"}
    assert {(c[1], c[2]) for c in calls} == {((2, 4), (8, 4)), ((2, 8), (3, 8))}
    times = r["times_s"]
    assert isinstance(times, dict) and [len(t) for t in times.values()] == [3, 3]
    assert r["bf16_over_float32"] == pytest.approx(r["bfloat16_ms"] / r["float32_ms"])  # type: ignore[operator]
