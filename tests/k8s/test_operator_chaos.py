"""The operator leg of the chaos soak (issue 11): a real `kvflow operator` against the real
API server is SIGKILLed at seeded random moments while two pools are created and rescaled
(changes land while it runs and while it is down). Afterwards every pool is Ready at its
latest generation with exactly its children: no Kubernetes object duplicated, none deleted
and made again, each Created event once.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from k8s.controlplane import ControlPlane
from k8s.operator_process import OperatorProcess
from k8s.pools import SMALL_SPEC, apply_pool, children, pool_events, wait_ready
from k8s.support import wait_for
from k8s.test_operator_ha import child_uids

POOLS = ("chaos-a", "chaos-b")
NUM_KILLS = 4
SEED = 11


def test_operator_killed_at_random_duplicates_nothing(
    cluster: ControlPlane, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    op = OperatorProcess(cluster, operator_kubeconfig, tmp_path, identity="op-chaos")
    replicas = dict.fromkeys(POOLS, 2)
    seen_uids: dict[str, str] = {}  # every child ever seen, by "Kind name"

    def rescale() -> None:
        pool = rng.choice(POOLS)
        replicas[pool] = rng.choice([1, 2, 3])
        spec = {**SMALL_SPEC, "colocated": {"replicas": replicas[pool]}}
        apply_pool(cluster, namespace, pool, spec)

    op.start()
    try:
        for pool in POOLS:
            apply_pool(cluster, namespace, pool, SMALL_SPEC)
        for _ in range(NUM_KILLS):
            time.sleep(rng.uniform(0.0, 4.0))  # mid-creation, mid-rescale, or idle
            rescale()
            time.sleep(rng.uniform(0.0, 2.0))
            for p in POOLS:
                seen_uids.update(child_uids(cluster, namespace, p))
            op.kill()
            if rng.random() < 0.5:  # a change while nobody reconciles
                rescale()
            op.start()  # waits for the crashed holder's Lease to expire (15 s)
        ready = {p: wait_ready(cluster, namespace, p) for p in POOLS}
    finally:
        op.stop()

    for pool in POOLS:
        deployments = children(cluster, namespace, pool, "deployments")
        names = sorted(d["metadata"]["name"] for d in deployments)
        assert names == [f"{pool}-colocated", f"{pool}-router"], names
        for kind, count in (("services", 2), ("configmaps", 1), ("poddisruptionbudgets", 2),
                            ("networkpolicies", 2)):  # fmt: skip
            assert len(children(cluster, namespace, pool, kind)) == count, (pool, kind)
        colocated = next(d for d in deployments if d["metadata"]["name"] == f"{pool}-colocated")
        assert colocated["spec"]["replicas"] == replicas[pool]
        assert ready[pool]["status"]["readyReplicas"] == replicas[pool]

        def pods_settled(pool: str = pool) -> bool:
            pods = children(cluster, namespace, pool, "pods")
            live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
            return len(live) == replicas[pool] + 1  # the workers and one router

        wait_for(pods_settled, 120, f"{pool}'s pods to settle")
        # Each child made once: its Created event appears at most once...
        created = [m for reason, m in pool_events(cluster, namespace, pool) if reason == "Created"]
        twice = [m for m, n in Counter(created).items() if n > 1]
        assert not twice, twice
    # ...and no child seen before a kill was deleted and made again later.
    now = {k: v for p in POOLS for k, v in child_uids(cluster, namespace, p).items()}
    remade = {k for k, uid in seen_uids.items() if k in now and now[k] != uid}
    assert not remade, remade
