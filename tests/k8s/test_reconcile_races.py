"""The reconciler in this process against the real API server, with a race window held open.

The operator's tests (test_operator.py, test_planner.py) meet these races only by chance,
under load. Here the reconciler's own `Kube` runs the competing write at the worst moment,
between the reconcile's read of the pool's children and its writes, so the outcome is the
same on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from k8s.controlplane import ControlPlane
from k8s.pools import apply_pool, get_pool, replica_owners

from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import Images
from kvflow.operator.kube import Kube, load_config
from kvflow.operator.reconcile import Reconciler

pytestmark = pytest.mark.usefixtures("crd")


class RacingKube(Kube):
    """A real `Kube` whose listing of one kind runs `then` once, after the list is read."""

    def __init__(self, cluster: ControlPlane, kind: str, then: Callable[[], None]) -> None:
        super().__init__(load_config(str(cluster.kubeconfig)))
        self._kind, self._then = kind, then
        self.fired = False

    def list_children(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Json]:
        listed = super().list_children(kind, namespace, selector)
        if kind == self._kind and not self.fired:
            self.fired = True
            self._then()
        return listed


def reconciler(kube: Kube) -> Reconciler:
    return Reconciler(
        kube=kube,
        images=Images("kvflow/worker:test", "kvflow/router:test"),
        post_event=lambda *_: None,
        now=lambda: "2026-01-01T00:00:00Z",
    )


def spec(**colocated: Any) -> dict[str, Any]:
    return {"model": {"servedName": "m"}, "colocated": {"replicas": 3, **colocated}}


def replicas_and_owners(cluster: ControlPlane, namespace: str) -> tuple[int, list[str]]:
    return replica_owners(cluster, namespace, "p-colocated")


def test_an_autoscaler_scaling_during_the_handover_keeps_its_count(
    cluster: ControlPlane, namespace: str
) -> None:
    apply_pool(cluster, namespace, "p", spec())
    plain = Kube(load_config(str(cluster.kubeconfig)))
    reconciler(plain).reconcile(namespace, "p")
    assert replicas_and_owners(cluster, namespace) == (3, ["kvflow-operator"])

    # Handed to an HPA, which scales to 2 after the operator read the Deployment at 3 and
    # before its handover write.
    apply_pool(cluster, namespace, "p", spec(externalAutoscaler=True))

    def hpa_scales_to_2() -> None:
        cluster.kubectl("scale", "deployment", "p-colocated", "-n", namespace, "--replicas", "2")

    racing = RacingKube(cluster, "Deployment", hpa_scales_to_2)
    reconciler(racing).reconcile(namespace, "p")
    assert racing.fired
    replicas, owners = replicas_and_owners(cluster, namespace)
    assert replicas == 2, owners  # a forced handover wrote its stale 3 back here
    assert "kvflow-operator" not in owners and "kvflow-operator-handover" not in owners, owners

    # Later reconciles leave the autoscaler's count alone.
    reconciler(plain).reconcile(namespace, "p")
    assert replicas_and_owners(cluster, namespace)[0] == 2


def test_a_status_refresh_claims_no_generation_it_did_not_apply(
    cluster: ControlPlane, namespace: str
) -> None:
    kube = Kube(load_config(str(cluster.kubeconfig)))
    apply_pool(cluster, namespace, "p", spec())
    reconciler(kube).reconcile(namespace, "p")
    assert get_pool(cluster, namespace, "p")["status"]["observedGeneration"] == 1

    apply_pool(cluster, namespace, "p", spec(replicas=4))
    # A Deployment event reaches the operator before the pool's own: a status refresh.
    reconciler(kube).reconcile(namespace, "p", apply=False)
    pool = get_pool(cluster, namespace, "p")
    assert pool["metadata"]["generation"] == 2
    assert pool["status"]["observedGeneration"] == 1  # `kubectl wait` must not pass yet
    assert replicas_and_owners(cluster, namespace)[0] == 3

    reconciler(kube).reconcile(namespace, "p")
    assert get_pool(cluster, namespace, "p")["status"]["observedGeneration"] == 2
    assert replicas_and_owners(cluster, namespace)[0] == 4
