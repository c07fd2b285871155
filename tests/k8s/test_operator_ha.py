"""Operator restarts and several replicas: no duplicates, one leader, clean failover."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from k8s.controlplane import SYSTEM_NAMESPACE, ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pools import SMALL_SPEC, apply_pool, children, event_reasons, pool_events, wait_ready
from k8s.support import wait_for


def lease_spec(cluster: ControlPlane, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = cluster.kubectl_json("get", "lease", name, "-n", SYSTEM_NAMESPACE)[
        "spec"
    ]
    return spec


def lease_holder(cluster: ControlPlane, name: str) -> str:
    return str(lease_spec(cluster, name).get("holderIdentity") or "")


def micro_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# With the pool's generated worker token Secret (created, not applied, but a child alike).
CHILD_KINDS = (
    "deployments", "services", "configmaps", "poddisruptionbudgets", "networkpolicies", "secrets",
)  # fmt: skip


def child_uids(cluster: ControlPlane, namespace: str, pool: str) -> dict[str, str]:
    """{"Kind name": uid} of the pool's children (the names its Created events use)."""
    return {
        f"{o['kind']} {o['metadata']['name']}": o["metadata"]["uid"]
        for kind in CHILD_KINDS
        for o in children(cluster, namespace, pool, kind)
    }


def test_operator_killed_mid_way_creates_no_duplicates(
    cluster: ControlPlane, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    op = OperatorProcess(cluster, operator_kubeconfig, tmp_path, identity="op-crash")
    op.start()
    try:
        apply_pool(cluster, namespace, "smol", SMALL_SPEC)
        # Kill (SIGKILL, nothing cleaned up) as soon as it has started creating children.
        wait_for(lambda: "Created" in event_reasons(cluster, namespace, "smol"), 60, "a child")
        op.kill()
        at_kill = child_uids(cluster, namespace, "smol")
        # The crashed leader's Lease must expire before the new process may lead (15 s).
        op.start()
        pool = wait_ready(cluster, namespace, "smol")
    finally:
        op.stop()

    deployments = children(cluster, namespace, "smol", "deployments")
    assert sorted(d["metadata"]["name"] for d in deployments) == ["smol-colocated", "smol-router"]
    for kind, count in (
        ("services", 2), ("configmaps", 1), ("poddisruptionbudgets", 2), ("networkpolicies", 2),
    ):  # fmt: skip
        assert len(children(cluster, namespace, "smol", kind)) == count, kind
    replica_sets = children(cluster, namespace, "smol", "replicasets")
    assert len(replica_sets) == 2  # one per Deployment: the template never changed
    pods = children(cluster, namespace, "smol", "pods")
    assert len(pods) == 3  # 2 workers + 1 router, none extra
    # No child was created twice across both processes: every child the first process
    # made is still the same object (same uid, not deleted and made again) ...
    after = child_uids(cluster, namespace, "smol")
    assert len(after) == 10, sorted(after)
    assert {key: after[key] for key in at_kill} == at_kill
    # ... every Created event names a child, once; the restarted process posted one for each
    # child it made. (The first may have died between applying a child and posting its event.)
    created = [m for reason, m in pool_events(cluster, namespace, "smol") if reason == "Created"]
    assert len(created) == len(set(created)), created
    assert {m.removeprefix("Created ") for m in created} <= set(after), created
    made_after_kill = set(after) - set(at_kill)
    assert {f"Created {key}" for key in made_after_kill} <= set(created), created
    assert pool["status"]["readyReplicas"] == 2


def test_only_the_lease_holder_acts_and_a_standby_takes_over(
    cluster: ControlPlane, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    lease = "kvflow-operator-ha"
    first = OperatorProcess(cluster, operator_kubeconfig, tmp_path, "op-first", lease)
    second = OperatorProcess(cluster, operator_kubeconfig, tmp_path, "op-second", lease)
    first.start()
    second.start(wait_leading=False)
    try:
        wait_for(lambda: "waiting for lease" in second.log(), 60, "the standby to wait")
        assert lease_holder(cluster, lease) == "op-first"
        # Both pass their liveness probe: a waiting standby must not be restarted.
        assert first.healthz() == "leading"
        assert second.healthz() == "waiting for lease"

        apply_pool(cluster, namespace, "one", SMALL_SPEC)
        wait_ready(cluster, namespace, "one")
        assert "leading as" not in second.log()

        before = lease_spec(cluster, lease)
        assert first.stop() == 0  # SIGTERM: a clean stop hands the Lease over at once
        released = lease_spec(cluster, lease)
        # Emptied by the release (or already the standby's): not left to expire.
        assert released.get("holderIdentity") in (None, "", "op-second"), released
        last_renewed = micro_time(
            (before if released.get("holderIdentity") else released)["renewTime"]
        )
        second.wait_leading(timeout_s=60)
        taken = lease_spec(cluster, lease)
        assert taken["holderIdentity"] == "op-second"
        # Taken before the old Lease could expire: without the release, the standby may take
        # it only from the last renewal + leaseDurationSeconds (15 s) on, never earlier.
        expiry = last_renewed + timedelta(seconds=int(before["leaseDurationSeconds"]))
        assert micro_time(taken["acquireTime"]) < expiry, (before, released, taken)
        assert second.healthz() == "leading"

        apply_pool(cluster, namespace, "two", SMALL_SPEC)
        wait_ready(cluster, namespace, "two")
    finally:
        first.stop()
        second.stop()


def test_a_leader_that_loses_its_lease_stops(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path: Path
) -> None:
    lease = "kvflow-operator-steal"
    op = OperatorProcess(cluster, operator_kubeconfig, tmp_path, "op-victim", lease)
    op.start()
    try:
        # Someone else writes the Lease as if it had won it (an operator on another
        # partition of the network, say): the victim must stop acting, not fight.
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        cluster.kubectl(
            "patch", "lease", lease, "-n", SYSTEM_NAMESPACE, "--type", "merge",
            "-p", f'{{"spec": {{"holderIdentity": "intruder", "renewTime": "{now}",'
            f' "leaseDurationSeconds": 3600}}}}',
        )  # fmt: skip
        assert op.proc is not None
        wait_for(lambda: op.proc.popen.poll() is not None, 60, "the victim to exit")  # type: ignore[union-attr]
        assert op.proc.popen.returncode == 1
        assert "lost lease" in op.log()
    finally:
        op.stop()
