"""Each role's planner inputs from what was read (pure): the windows of direct scrapes
sorted into each role's targets, and the targets made into each role's `Observation`
(observe/observation.py does the arithmetic). planning.py reads; this arranges."""

from __future__ import annotations

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import PoolRef, WorkerRole, worker_deployment_name, worker_roles
from kvflow.operator.observe.exposition import Metrics
from kvflow.operator.observe.observation import Slo, Targets, observe_role
from kvflow.operator.observe.pods import PoolPods, RolePods
from kvflow.operator.planner.types import Observation


def scraped_targets(
    spec: v1alpha1.InferencePoolSpec, pods: PoolPods, windows: dict[str, Metrics]
) -> dict[WorkerRole, Targets]:
    """Each role's windows from direct scrapes: its ready pods' and every router's, the
    pool's own and (this pool's series of) the gateways' that front it."""
    urls = [*pods.router_targets, *pods.gateway_targets]
    routers = [windows[url] for url in urls if url in windows]
    out: dict[WorkerRole, Targets] = {}
    for role, _ in worker_roles(spec):
        role_pods = pods.roles.get(role, RolePods())
        workers = [windows[url] for url in role_pods.targets if url in windows]
        # The load is the workers' counts: one unread leaves its share out. (A router's
        # missing read only drops its refusals and latencies, as before.)
        unread = len(role_pods.targets) - len(workers)
        out[role] = Targets(workers=workers, routers=routers, num_unread=unread)
    return out


def observations_of(
    spec: v1alpha1.InferencePoolSpec,
    pool: PoolRef,
    pods: PoolPods,
    deployments: dict[str, Json],
    targets: dict[WorkerRole, Targets],
    now_s: float,
    window_s: float,
) -> dict[WorkerRole, Observation]:
    slo = Slo(
        ttft_target_s=spec.slo.ttft_target_ms / 1000,
        tpot_target_s=spec.slo.tpot_target_ms / 1000,
        percentile=spec.slo.percentile,
    )
    out: dict[WorkerRole, Observation] = {}
    for role, role_spec in worker_roles(spec):
        role_pods = pods.roles.get(role, RolePods())
        deployment = deployments.get(worker_deployment_name(pool, role))
        desired = (
            int((deployment.get("spec") or {}).get("replicas") or 0)
            if deployment is not None
            else role_spec.replicas
        )
        out[role] = observe_role(
            role,
            time_s=now_s,
            window_s=window_s,
            desired_replicas=desired,
            pods=role_pods,
            targets=targets.get(role, Targets(workers=[], routers=[])),
            slo=slo,
        )
    return out
