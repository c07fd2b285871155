"""A tenant's fair share by priority: the workers' fair queue and the gateway's admission weigh
tenants with the same function, so a tenant's share is the same wherever it waits."""

from __future__ import annotations

# A tenant one priority level more urgent (priority one lower) gets twice the share of
# tokens while both are backlogged: two levels four times, and so on. Clamped to +-16
# levels (65,536x), which is strict in practice and keeps the counters finite.
PRIORITY_WEIGHT_BASE = 2.0
MAX_PRIORITY_LEVELS = 16


def priority_weight(priority: int) -> float:
    """A tenant's share weight: 1 at priority 0, doubling per level more urgent."""
    levels = max(-MAX_PRIORITY_LEVELS, min(MAX_PRIORITY_LEVELS, priority))
    return float(PRIORITY_WEIGHT_BASE ** (-levels))
