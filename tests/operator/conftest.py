"""Fixtures the operator's tests share."""

from __future__ import annotations

import pytest


@pytest.fixture()
def events() -> list[tuple[str, str, str]]:
    """The Events a reconcile posts, as (type, reason, message)."""
    return []
