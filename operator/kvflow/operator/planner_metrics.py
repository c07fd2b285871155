"""The operator's Prometheus metrics for the planner: every input and every decision.

Named `kvflow_operator_planner_<what>`; labels are the pool (namespace, name), the role
and, for inputs, the input's name (the fields of `planner.types.Observation`, a fixed set),
so cardinality is pools x roles x 14. An input the planner did not have is NaN, not 0.
"""

from __future__ import annotations

import math
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvflow.operator.planner.types import Decision, Observation, SloVerdict

# Values the planner reads per role, in Observation's own units (seconds, ratios, tokens).
INPUTS = tuple(f.name for f in fields(Observation) if f.name != "time_s")
_SLO_VALUE = {"True": 1.0, "False": 0.0, "Unknown": math.nan}


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        pool = ["namespace", "pool"]
        self.inputs = Gauge(
            "kvflow_operator_planner_input",
            "What the planner observed for a role last interval (NaN: not measured)",
            [*pool, "role", "input"],
            registry=r,
        )
        self.replicas = Gauge(
            "kvflow_operator_planner_replicas",
            "Replicas the planner decided for a role",
            [*pool, "role"],
            registry=r,
        )
        self.decisions = Counter(
            "kvflow_operator_planner_decisions",
            "Planner decisions per role by reason (one per role and interval)",
            [*pool, "role", "reason"],
            registry=r,
        )
        self.scalings = Counter(
            "kvflow_operator_planner_scalings",
            "Replica changes the planner made, by direction (up, down)",
            [*pool, "role", "direction"],
            registry=r,
        )
        self.slo_met = Gauge(
            "kvflow_operator_planner_slo_met",
            "The SLOMet condition: 1 met, 0 violated, NaN unknown",
            pool,
            registry=r,
        )
        self.scrape_failures = Counter(
            "kvflow_operator_planner_scrape_failures",
            "Metrics targets of a pool that did not answer or answered garbage",
            pool,
            registry=r,
        )
        self.prometheus_failures = Counter(
            "kvflow_operator_planner_prometheus_failures",
            "Intervals a pool's Prometheus (autoscaling.prometheus) gave no usable answer",
            pool,
            registry=r,
        )
        self.interval_failures = Counter(
            "kvflow_operator_planner_interval_failures",
            "Intervals of a pool that failed on an unexpected error (logged; the planner "
            "goes on with the other pools and tries this one at its next interval)",
            pool,
            registry=r,
        )
        self.interval_s = Histogram(
            "kvflow_operator_planner_interval_seconds",
            "One planner interval of one pool: list pods, scrape, decide, write",
            pool,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )

    def observed(self, namespace: str, pool: str, role: str, obs: Observation) -> None:
        for name in INPUTS:
            value = getattr(obs, name)
            self.inputs.labels(namespace, pool, role, name).set(
                math.nan if value is None else float(value)
            )

    def decided(self, namespace: str, pool: str, decision: Decision) -> None:
        self.replicas.labels(namespace, pool, decision.role).set(decision.replicas)
        self.decisions.labels(namespace, pool, decision.role, decision.reason).inc()
        if decision.is_change:
            direction = "up" if decision.replicas > decision.previous_replicas else "down"
            self.scalings.labels(namespace, pool, decision.role, direction).inc()

    def judged(self, namespace: str, pool: str, slo: SloVerdict) -> None:
        self.slo_met.labels(namespace, pool).set(_SLO_VALUE[slo.status])

    def unobserved(self, namespace: str, pool: str, role: str) -> None:
        """No inputs this interval (Prometheus did not answer): NaN, not the last ones."""
        for name in INPUTS:
            self.inputs.labels(namespace, pool, role, name).set(math.nan)

    def forget(self, namespace: str, pool: str) -> None:
        """Drop every series of a pool the planner no longer plans (deleted, or its
        autoscaling off): a dashboard would show its last replicas and SLO for good."""
        for metric in (self.inputs, self.replicas, self.decisions, self.scalings, self.slo_met,
                       self.scrape_failures, self.prometheus_failures, self.interval_failures,
                       self.interval_s):  # fmt: skip
            names = metric._labelnames
            doomed = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("namespace") == namespace and sample.labels.get("pool") == pool
            }
            for values in doomed:
                metric.remove(*values)
