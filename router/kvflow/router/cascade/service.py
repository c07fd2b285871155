"""The cascades in force: which requests get one, and the count of each outcome
(``kvflow_router_cascade_total{model,outcome}``: answered_small, escalated_<reason>)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter

from kvflow.router.cascade.checks import REASONS, Reason
from kvflow.router.cascade.config import CascadeSpec
from kvflow.router.tenants.config import Tenant

CASCADE_HEADER = "x-kvflow-cascade"
ANSWERED_SMALL = "answered_small"
OUTCOMES = (ANSWERED_SMALL, *(f"escalated_{r}" for r in REASONS))


def outcome(reason: Reason | None) -> str:
    return ANSWERED_SMALL if reason is None else f"escalated_{reason}"


def header(reason: Reason | None) -> str:
    """The ``x-kvflow-cascade`` value: ``small``, or ``escalated:<reason>``."""
    return "small" if reason is None else f"escalated:{reason}"


class Cascade:
    """Every configured model's cascade; ``specs`` empty: off."""

    def __init__(
        self, specs: Mapping[str, CascadeSpec], registry: CollectorRegistry | None = None
    ) -> None:
        self._by_name = {name: spec for spec in specs.values() for name in spec.names}
        self._counter: Counter | None = None
        if registry is not None and specs:
            self._counter = Counter(
                "kvflow_router_cascade_total",
                "Requests of a cascaded model, by outcome: answered by the small model, or "
                "escalated to the large one (and why)",
                ["model", "outcome"],
                registry=registry,
            )
            for spec in specs.values():  # every series from the start, at 0
                for name in OUTCOMES:
                    self._counter.labels(spec.model, name)

    def plan(self, model: str, tenant: Tenant) -> CascadeSpec | None:
        """The cascade for a request of ``model``; None when there is none, or the tenant
        may not use both its models (it gets the name's own targets instead)."""
        spec = self._by_name.get(model)
        if spec is None or not (tenant.may_use(spec.small) and tenant.may_use(spec.large)):
            return None
        return spec

    def count(self, spec: CascadeSpec, reason: Reason | None) -> None:
        if self._counter is not None:
            self._counter.labels(spec.model, outcome(reason)).inc()
