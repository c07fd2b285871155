"""The Lease decision (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kvflow.operator.leader import LeaseState, may_take, read_state

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("holder", "renewed_ago_s", "allowed"),
    [
        ("", 0, True),  # released
        ("me", 0, True),  # renewing my own
        ("other", 0, False),
        ("other", 14.9, False),
        ("other", 15, True),  # expired
        ("other", None, True),  # never renewed
    ],
)
def test_may_take(holder: str, renewed_ago_s: float | None, allowed: bool) -> None:
    renewed = None if renewed_ago_s is None else NOW - timedelta(seconds=renewed_ago_s)
    assert may_take(LeaseState(holder, renewed, 15, 0), "me", NOW) is allowed


def test_read_state_parses_micro_time() -> None:
    state = read_state(
        {
            "spec": {
                "holderIdentity": "op-a",
                "renewTime": "2026-01-01T11:59:59.500000Z",
                "leaseDurationSeconds": 20,
                "leaseTransitions": 3,
            }
        }
    )
    assert state == LeaseState("op-a", NOW - timedelta(seconds=0.5), 20, 3)
    assert read_state({}) == LeaseState("", None, 15, 0)
