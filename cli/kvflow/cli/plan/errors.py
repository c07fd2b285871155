"""The one exception the planner raises for input a user can fix."""

from __future__ import annotations

import math


class PlanError(ValueError):
    """A GPU, model, workload or SLO that cannot be planned; the message says what to change.

    Raised for bad input only; a broken invariant in our own arithmetic stays an assert.
    """


def is_positive(value: float) -> bool:
    """A finite number above zero. (``value <= 0`` lets NaN and infinity through: a NaN
    rate reached ``math.ceil`` as "cannot convert float NaN to integer".)"""
    return math.isfinite(value) and value > 0


def is_non_negative(value: float) -> bool:
    """A finite number at or above zero."""
    return math.isfinite(value) and value >= 0
