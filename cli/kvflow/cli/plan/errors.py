"""The one exception the planner raises for input a user can fix."""

from __future__ import annotations


class PlanError(ValueError):
    """A GPU, model, workload or SLO that cannot be planned; the message says what to change.

    Raised for bad input only; a broken invariant in our own arithmetic stays an assert.
    """
