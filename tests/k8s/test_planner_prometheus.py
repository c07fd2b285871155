"""A pool whose Prometheus does not answer, in the real operator against the real API
server: the planner holds replicas, says why in status, and goes on running.

(The Prometheus source's answers against a real Prometheus: tests/operator/
test_planner_prometheus.py.)
"""

from __future__ import annotations

import urllib.request

from k8s.controlplane import ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pools import apply_pool, condition, get_pool, pool_events, wait_ready
from k8s.support import wait_for
from k8s.test_planner import deployment_replicas, loopback_node, planner_spec
from testkit.ports import free_port

__all__ = ["loopback_node"]  # the fixture, used by name


def test_an_unreachable_prometheus_holds_replicas_and_says_so(
    cluster: ControlPlane, namespace: str, operator: OperatorProcess, loopback_node: str
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    spec = planner_spec(loopback_node, replicas=2)
    spec["autoscaling"]["prometheus"] = {"url": url}
    apply_pool(cluster, namespace, "blind", spec)
    wait_ready(cluster, namespace, "blind")

    def held() -> bool:
        status = get_pool(cluster, namespace, "blind").get("status", {})
        try:
            slo = condition({"status": status}, "SLOMet")
        except StopIteration:
            return False
        return slo["reason"] == "PrometheusUnavailable"

    wait_for(held, 60, "SLOMet to say PrometheusUnavailable")
    status = get_pool(cluster, namespace, "blind")["status"]
    slo = condition({"status": status}, "SLOMet")
    assert slo["status"] == "Unknown" and url in slo["message"], slo
    assert "colocated: PrometheusUnavailable: cannot read" in status["planner"]["reason"]
    assert status["planner"]["lastDecision"] == "colocated 2"
    assert status["planner"]["roles"] == [{"name": "colocated", "replicas": 2}]

    def failures_counted() -> float:
        metrics_url = f"http://127.0.0.1:{operator.liveness_port}/metrics"
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        counts = [
            float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("kvflow_operator_planner_prometheus_failures_total")
            and 'pool="blind"' in line
        ]  # fmt: skip
        return counts[0] if counts else 0.0

    # Two more intervals (5 s each), counted by the operator's own metric rather than slept
    # through: a loaded CI machine once ran only one of them in 12 s.
    wait_for(lambda: failures_counted() >= 3, 60, "two more failed Prometheus reads")
    # Still held, the operator still running, and one Warning when it started, not one
    # per interval.
    assert deployment_replicas(cluster, namespace, "blind-colocated") == 2
    warnings = [
        m for r, m in pool_events(cluster, namespace, "blind") if r == "PrometheusUnavailable"
    ]
    assert len(warnings) == 1 and warnings[0].startswith("colocated held at 2: "), warnings
    assert operator.proc is not None and operator.proc.popen.poll() is None
