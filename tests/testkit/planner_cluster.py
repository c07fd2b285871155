"""A pool around the real PlanningLoop: its scrape parsing, windows, observations, model
and decision path run as in the operator; Kubernetes is a dict and each worker's /metrics
page comes from prometheus_client objects under the workers' real family names (the real
HTTP scrape: tests/operator/test_planner_scrape.py; the whole loop on a real API server:
tests/k8s/test_planner.py)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.operator import planning
from kvflow.operator.admin_policy import AdminPolicy
from kvflow.operator.planner_metrics import PlannerMetrics
from kvflow.operator.planning import PlanningLoop
from kvflow.operator.reconcile import PlanOutcome
from kvflow.proto import metric_names as n

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 60.0)
INTERVAL_S = 30.0
CLASS = "normal"


class Worker:
    """One worker's metrics page."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        label = [n.CLASS_LABEL]
        self.finished = Counter(n.WORKER_FINISHED, "", ["finish_reason", n.CLASS_LABEL],
                                registry=r)  # fmt: skip
        self.prompt = Counter(n.WORKER_PROMPT_TOKENS, "", label, registry=r)
        self.generated = Counter(n.WORKER_GENERATION_TOKENS, "", label, registry=r)
        self.ttft = Histogram(n.WORKER_TTFT, "", label, buckets=BUCKETS, registry=r)
        self.tpot = Histogram(n.WORKER_TPOT, "", label, buckets=BUCKETS, registry=r)
        self.queue_wait = Histogram(n.WORKER_QUEUE_WAIT, "", label, buckets=BUCKETS, registry=r)
        self.running = Gauge(n.WORKER_RUNNING, "", label, registry=r)
        self.waiting = Gauge(n.WORKER_WAITING, "", label, registry=r)
        self.kv = Gauge(n.WORKER_KV_USAGE, "", registry=r)
        self.kv.set(0.3)
        self.running.labels(CLASS).set(5)
        self.waiting.labels(CLASS).set(0)

    def serve(self, requests: int, ttft_s: float = 0.2, tpot_s: float = 0.03,
              observed: int | None = None) -> None:  # fmt: skip
        """``requests`` finished, 1,000 prompt and 200 output tokens each; ``observed`` of
        them (default all) in the latency histograms."""
        self.finished.labels("stop", CLASS).inc(requests)
        self.prompt.labels(CLASS).inc(requests * 1000)
        self.generated.labels(CLASS).inc(requests * 200)
        for _ in range(requests if observed is None else observed):
            self.ttft.labels(CLASS).observe(ttft_s)
            self.tpot.labels(CLASS).observe(tpot_s)
            self.queue_wait.labels(CLASS).observe(0.01)

    def page(self) -> str:
        return generate_latest(self.registry).decode()


def pool_body(colocated: dict[str, Any] | None = None, **autoscaling: Any) -> dict[str, Any]:
    spec = {
        "model": {"servedName": "m"},
        "mode": "colocated",
        "colocated": colocated or {"replicas": 4, "minReplicas": 1, "maxReplicas": 16},
        "router": {"replicas": 1, "allowUnauthenticated": True},
        "slo": {"ttftTargetMs": 1000, "tpotTargetMs": 100, "percentile": 90},
        "autoscaling": {"enabled": True, "intervalSeconds": int(INTERVAL_S), **autoscaling},
    }
    return {"apiVersion": "kvflow.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "generation": 1},
            "spec": spec}  # fmt: skip


def _pod(i: int) -> dict[str, Any]:
    labels = {"kvflow.io/pool": "p", "kvflow.io/role": "colocated",
              "app.kubernetes.io/component": "worker"}  # fmt: skip
    return {"metadata": {"name": f"w{i}", "labels": labels},
            "status": {"podIP": f"10.0.0.{i}",
                       "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip


class _Kube:
    def __init__(self, body: dict[str, Any], num_workers: int) -> None:
        self.bodies = [body]
        self.pods = [_pod(i) for i in range(1, num_workers + 1)]
        self.deployment = {"metadata": {"name": "p-colocated"}, "spec": {"replicas": num_workers}}

    def list_pool_objects(self, namespaces: list[str]) -> list[dict[str, Any]]:
        return copy.deepcopy(self.bodies)

    def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return list(self.pods) if "kvflow.io/pool" in labels else []

    def list_children(self, kind: str, namespace: str, labels: Any) -> list[dict[str, Any]]:
        return [self.deployment]


class _Reconciler:
    """Applies each decision to the Deployment, as the operator's reconcile does."""

    def __init__(self, kube: _Kube) -> None:
        self.kube, self.policy = kube, AdminPolicy()
        self.outcomes: list[PlanOutcome] = []

    def record_plan(self, namespace: str, name: str, decide: Any) -> PlanOutcome | None:
        outcome: PlanOutcome | None = decide(copy.deepcopy(self.kube.bodies[0]))
        if outcome is not None:
            for decision in outcome.decisions:
                self.kube.deployment["spec"]["replicas"] = decision.replicas
            self.outcomes.append(outcome)
        return outcome

    def post_event(self, body: Any, *event: Any) -> None:
        pass


class PlannerCluster:
    """``interval()`` runs one planner interval, then moves the clock on by one."""

    def __init__(self, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                 num_workers: int = 4) -> None:  # fmt: skip
        self.workers = {f"http://10.0.0.{i}:9400/metrics": Worker()
                        for i in range(1, num_workers + 1)}  # fmt: skip
        self.kube = _Kube(body, num_workers)
        self.reconciler = _Reconciler(self.kube)
        self.now_s = 1000.0
        self.metrics = PlannerMetrics()
        self.loop = PlanningLoop(self.kube, self.reconciler, self.metrics, ["ns"],  # type: ignore[arg-type]
                                 clock=lambda: self.now_s, policy=AdminPolicy())  # fmt: skip
        self.down: set[str] = set()  # targets that do not answer
        self.pages: dict[str, str] = {}  # targets that answer this instead of their page

        async def fetch_all(urls: list[str], timeout_s: float = 2.0) -> dict[str, str]:
            return {u: self.pages.get(u) or self.workers[u].page()
                    for u in set(urls) if u in self.workers and u not in self.down}  # fmt: skip

        monkeypatch.setattr(planning, "fetch_all", fetch_all)

    @property
    def replicas(self) -> int:
        return int(self.kube.deployment["spec"]["replicas"])

    def input(self, name: str) -> float:
        return float(self.metrics.inputs.labels("ns", "p", "colocated", name)._value.get())

    def interval(self) -> PlanOutcome | None:
        before = len(self.reconciler.outcomes)
        try:
            asyncio.run(self.loop.tick())
        finally:
            self.now_s += INTERVAL_S
        return self.reconciler.outcomes[-1] if len(self.reconciler.outcomes) > before else None
