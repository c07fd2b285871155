"""A worker's load as the router sees it between reports (pure: the gateway's worker pool and
the simulator's router side both use it)."""

from __future__ import annotations

# How often the pool asks each worker for its load (and every HEALTH_EVERY_N_LOADS-th
# time, its health): a quarter second keeps routing within a few requests of the truth.
LOAD_INTERVAL_S = 0.25


def estimate_queue_depth(num_reported: int, num_local_now: int, num_local_at_report: int) -> int:
    """Requests queued or running on a worker: its last report, corrected by what this
    router has started or finished there since (reports are up to LOAD_INTERVAL_S old)."""
    return max(0, num_reported + num_local_now - num_local_at_report)
