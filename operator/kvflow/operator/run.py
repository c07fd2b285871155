"""The operator process: lead (or wait to), then run kopf and the drift sweep together."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from datetime import UTC, datetime

import kopf

from kvflow.operator.admin_policy import AdminPolicy
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.names import Images
from kvflow.operator.gateway_reconcile import GatewayReconciler
from kvflow.operator.handlers import build_registry
from kvflow.operator.health import serve_health
from kvflow.operator.kube import Kube, KubeError
from kvflow.operator.leader import LeaderElector
from kvflow.operator.planner_metrics import PlannerMetrics
from kvflow.operator.planning import PlanningLoop
from kvflow.operator.reconcile import Reconciler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OperatorConfig:
    images: Images
    namespaces: list[str]  # empty: every namespace
    drift_interval_s: float
    liveness_port: int  # 0: no liveness endpoint
    leader_election: bool
    lease_namespace: str
    lease_name: str
    identity: str
    # What pool authors may ask for (admin_policy); frozen, so one shared default is safe.
    policy: AdminPolicy = AdminPolicy()  # noqa: RUF009


@dataclass
class _Role:
    """What /healthz reports: "waiting for lease" or "leading"."""

    now: str


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def run_operator(cfg: OperatorConfig, kube: Kube) -> int:
    """Returns the exit status: 0 on SIGTERM/SIGINT, 1 when leadership was lost."""
    stop = asyncio.Event()
    lost = asyncio.Event()
    loop = asyncio.get_running_loop()
    role = _Role("waiting for lease" if cfg.leader_election else "leading")
    metrics = PlannerMetrics()
    health = (
        await serve_health(cfg.liveness_port, lambda: role.now, metrics.registry)
        if cfg.liveness_port
        else None
    )
    try:
        return await _lead_and_run(cfg, kube, stop, lost, loop, role, metrics)
    finally:
        if health is not None:
            await health.cleanup()


async def _lead_and_run(
    cfg: OperatorConfig,
    kube: Kube,
    stop: asyncio.Event,
    lost: asyncio.Event,
    loop: asyncio.AbstractEventLoop,
    role: _Role,
    metrics: PlannerMetrics,
) -> int:
    elector: LeaderElector | None = None
    if cfg.leader_election:
        elector = LeaderElector(kube, cfg.lease_namespace, cfg.lease_name, cfg.identity)
        # Until kopf installs its own handlers, a stop signal must end the wait for the lease.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        acquired = asyncio.create_task(elector.acquire())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({acquired, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if stop.is_set():
            acquired.cancel()
            return 0
        stopped.cancel()
        acquired.result()  # a failed wait for the lease raises here, never leads
        role.now = "leading"

    def post_event(body: Json, type_: str, reason: str, message: str) -> None:
        try:
            kube.post_event(body, type_, reason, message, now_rfc3339())
        except KubeError as exc:  # Events are best effort; the status says the same
            log.warning("could not post event %s on %s: %s", reason, body["metadata"]["name"], exc)

    reconciler = Reconciler(
        kube=kube, images=cfg.images, post_event=post_event, now=now_rfc3339, policy=cfg.policy
    )
    gateways = GatewayReconciler(
        kube=kube, images=cfg.images, post_event=post_event, now=now_rfc3339, policy=cfg.policy
    )
    planning = PlanningLoop(kube, reconciler, metrics, cfg.namespaces)
    tasks = [
        asyncio.create_task(_sweep(reconciler, kube, cfg)),
        asyncio.create_task(_sweep_gateways(gateways, kube, cfg)),
        asyncio.create_task(planning.run()),
    ]
    if elector is not None:
        tasks.append(asyncio.create_task(elector.keep(lost)))
    try:
        await kopf.operator(
            registry=build_registry(reconciler, gateways, namespaced=bool(cfg.namespaces)),
            standalone=True,  # leadership is ours (the Lease), not kopf's peering
            clusterwide=not cfg.namespaces,
            namespaces=cfg.namespaces,
            stop_flag=lost,
        )
    finally:
        for task in tasks:
            task.cancel()
        if elector is not None and not lost.is_set():
            await asyncio.to_thread(elector.release)
    return 1 if lost.is_set() else 0


async def _sweep(reconciler: Reconciler, kube: Kube, cfg: OperatorConfig) -> None:
    """Re-apply every pool periodically: puts back children deleted or edited by hand
    (Services, ConfigMaps, budgets are not watched, so this is how their drift is found)."""
    while True:
        await asyncio.sleep(cfg.drift_interval_s)
        try:
            pools = await asyncio.to_thread(kube.list_pools, cfg.namespaces)
        except KubeError as exc:
            log.warning("drift sweep: cannot list pools: %s", exc)
            continue
        for namespace, name in pools:
            try:
                await asyncio.to_thread(reconciler.reconcile, namespace, name)
            except KubeError as exc:
                log.warning("drift sweep: %s/%s: %s", namespace, name, exc)
            except Exception:  # a bug in one pool's reconcile must not end the sweep
                log.exception("drift sweep: %s/%s failed", namespace, name)


async def _sweep_gateways(gateways: GatewayReconciler, kube: Kube, cfg: OperatorConfig) -> None:
    """Re-apply every namespace's gateways periodically, as `_sweep` does pools."""
    while True:
        await asyncio.sleep(cfg.drift_interval_s)
        try:
            listed = await asyncio.to_thread(
                lambda: [
                    o["metadata"]["namespace"]
                    for plural in (gw.GATEWAY_PLURAL, gw.MODEL_PLURAL)
                    for o in kube.list_objects(plural, cfg.namespaces)
                ]
            )
        except KubeError as exc:
            log.warning("drift sweep: cannot list gateways: %s", exc)
            continue
        for namespace in sorted(set(listed)):
            try:
                await asyncio.to_thread(gateways.reconcile_namespace, namespace)
            except KubeError as exc:
                log.warning("drift sweep: gateways of %s: %s", namespace, exc)
            except Exception:  # as _sweep
                log.exception("drift sweep: gateways of %s failed", namespace)
