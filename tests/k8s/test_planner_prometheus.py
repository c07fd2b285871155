"""A pool whose Prometheus does not answer, in the real operator against the real API
server: the planner holds replicas, says why in status, and goes on running. A pool whose
Prometheus the operator's administrator did not allow is refused, and never queried.

(The Prometheus source's answers against a real Prometheus: tests/operator/
test_planner_prometheus.py.)
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from k8s.controlplane import ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pools import apply_pool, condition, get_pool, pool_events, wait_ready
from k8s.support import wait_for
from k8s.test_planner import deployment_replicas, loopback_node, planner_spec
from testkit.ports import free_port

__all__ = ["loopback_node"]  # the fixture, used by name


UNREACHABLE = f"http://127.0.0.1:{free_port()}"


@pytest.fixture()
def operator(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator allowed to query UNREACHABLE only."""
    proc = OperatorProcess(
        cluster, operator_kubeconfig, tmp_path, identity="op-prom",
        extra_args=("--allowed-prometheus-url", UNREACHABLE),
    )  # fmt: skip
    proc.start()
    yield proc
    proc.stop()


def test_an_unreachable_prometheus_holds_replicas_and_says_so(
    cluster: ControlPlane, namespace: str, operator: OperatorProcess, loopback_node: str
) -> None:
    url = UNREACHABLE
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


class _Recorder(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        _Recorder.hits.append(self.path)
        body = b'{"status": "success", "data": {"resultType": "vector", "result": []}}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_prometheus_the_operator_does_not_allow_is_never_queried(
    cluster: ControlPlane, namespace: str, operator: OperatorProcess, loopback_node: str
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"  # answers, but not allowed
        spec = planner_spec(loopback_node, replicas=2)
        spec["autoscaling"]["prometheus"] = {"url": url}
        apply_pool(cluster, namespace, "nosy", spec)

        def refused() -> dict[str, str] | None:
            status = get_pool(cluster, namespace, "nosy").get("status", {})
            try:
                degraded = condition({"status": status}, "Degraded")
                slo = condition({"status": status}, "SLOMet")
            except StopIteration:
                return None
            ok = degraded["reason"] == slo["reason"] == "PrometheusNotAllowed"
            return {"degraded": degraded["message"], "slo": slo["message"]} if ok else None

        messages = wait_for(refused, 60, "Degraded and SLOMet to say PrometheusNotAllowed")
        for message in messages.values():
            assert url in message and "--allowed-prometheus-url" in message, message
            assert UNREACHABLE in message, message  # what is allowed
        # Two more planner intervals (5 s each): still not one request.
        time.sleep(12)
        assert _Recorder.hits == []
        assert cluster.kubectl_json("get", "deployments", "-n", namespace)["items"] == []
    finally:
        server.shutdown()
