"""The thin layer: which kopf events reconcile a pool, and the operator's flags."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.operator.cli import DEFAULT_WORKER_IMAGE, parse_args
from kvflow.operator.handlers import needs_reconcile


def decide(type_: str | None, generation: int, observed: int | None) -> bool:
    status: dict[str, Any] = {} if observed is None else {"observedGeneration": observed}
    return needs_reconcile(type=type_, meta={"generation": generation}, status=status)


@pytest.mark.parametrize(
    ("type_", "generation", "observed", "expected"),
    [
        (None, 3, 3, True),  # the operator's initial listing: always converge
        ("ADDED", 1, None, True),
        ("MODIFIED", 2, 1, True),  # a spec change the status has not caught up with
        ("MODIFIED", 2, 2, False),  # our own status write: nothing to do
        ("DELETED", 2, 1, False),  # garbage collection's job
    ],
)
def test_needs_reconcile(
    type_: str | None, generation: int, observed: int | None, expected: bool
) -> None:
    assert decide(type_, generation, observed) is expected


def test_operator_flags_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "kvflow-system")
    monkeypatch.setenv("POD_NAME", "kvflow-operator-abc")
    args = parse_args(["--namespace", "a", "--namespace", "b", "--no-leader-election"])
    assert args.namespaces == ["a", "b"]
    assert args.leader_election is False
    assert args.lease_namespace == "kvflow-system"
    assert args.identity == "kvflow-operator-abc"
    assert args.worker_image == DEFAULT_WORKER_IMAGE
    assert args.drift_interval_seconds == 30.0
