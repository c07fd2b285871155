"""Leader election on a coordination.k8s.io Lease, so several operator replicas are safe.

Only the replica holding the Lease runs handlers; the others wait to take over. The holder
renews every `renew_s`; a Lease not renewed for `duration_s` is up for grabs. Replacing the
Lease carries its resourceVersion, so when two replicas race, the API server lets exactly
one win (the other gets 409 Conflict). A leader that cannot renew before its Lease expires
stops (the process exits and its pod restarts as a follower): two leaders must never act
at once, and stopping is the one way to be sure it has stopped.

Chosen over kopf's peering: peering freezes operators of lower priority but lets operators
of equal priority run side by side, needs its own CRD, and cannot give up leadership on a
lost connection. A Lease is what kube-controller-manager itself uses.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kvflow.operator.api.schema import Json
from kvflow.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)

# kube-controller-manager's defaults: a leader is replaced within 15 s of dying and renews
# three times per lease, so one slow API call does not cost it leadership.
LEASE_DURATION_S = 15
RENEW_PERIOD_S = 5


@dataclass(frozen=True)
class LeaseState:
    holder: str
    renewed_at: datetime | None
    duration_s: int
    transitions: int


def read_state(lease: Json) -> LeaseState:
    spec = lease.get("spec") or {}
    renewed = spec.get("renewTime")
    return LeaseState(
        holder=spec.get("holderIdentity") or "",
        renewed_at=_parse_time(renewed) if renewed else None,
        duration_s=int(spec.get("leaseDurationSeconds") or LEASE_DURATION_S),
        transitions=int(spec.get("leaseTransitions") or 0),
    )


def may_take(state: LeaseState, identity: str, now: datetime) -> bool:
    """Pure: may `identity` (re)write the Lease now?"""
    if state.holder in ("", identity) or state.renewed_at is None:
        return True
    return now >= state.renewed_at + timedelta(seconds=state.duration_s)


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        duration_s: int = LEASE_DURATION_S,
        renew_s: int = RENEW_PERIOD_S,
    ) -> None:
        assert renew_s < duration_s, "renewing slower than the lease expires loses it"
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s, self.renew_s = duration_s, renew_s

    def try_acquire(self) -> bool:
        """One attempt to take or renew the Lease; True while we hold it."""
        now = datetime.now(UTC)
        lease = self.kube.read_lease(self.namespace, self.name)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration_s,
            "renewTime": _micro_time(now),
        }
        try:
            if lease is None:
                spec |= {"acquireTime": _micro_time(now), "leaseTransitions": 0}
                self.kube.create_lease(
                    self.namespace,
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": spec,
                    },
                )
                return True
            state = read_state(lease)
            if not may_take(state, self.identity, now):
                return False
            if state.holder != self.identity:
                spec |= {"acquireTime": _micro_time(now), "leaseTransitions": state.transitions + 1}
            lease["spec"] = {**(lease.get("spec") or {}), **spec}
            self.kube.replace_lease(self.namespace, self.name, lease)
            return True
        except KubeError as exc:
            if exc.status == 409:  # someone else created or renewed it first
                return False
            raise

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        waiting_logged = False
        while not await self._attempt():
            if not waiting_logged:
                log.info(
                    "waiting for lease %s/%s (another replica leads)", self.namespace, self.name
                )
                waiting_logged = True
            await asyncio.sleep(self.renew_s)
        log.info("leading as %s (lease %s/%s)", self.identity, self.namespace, self.name)

    async def keep(self, lost: asyncio.Event) -> None:
        """Renew until the Lease cannot be renewed within its duration; then set `lost`."""
        last_renewed = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.renew_s)
            if await self._attempt():
                last_renewed = asyncio.get_running_loop().time()
            elif asyncio.get_running_loop().time() - last_renewed >= self.duration_s - self.renew_s:
                log.error("lost lease %s/%s; stopping", self.namespace, self.name)
                lost.set()
                return

    async def _attempt(self) -> bool:
        try:
            # At most a renewal period: a call left hanging (the client's own timeout is
            # 30 s, twice the lease) must not keep a leader from seeing its lease lapse.
            return await asyncio.wait_for(asyncio.to_thread(self.try_acquire), self.renew_s)
        except KubeError as exc:
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            return False
        except TimeoutError:
            log.warning("lease %s/%s: no answer within %.0f s", self.namespace, self.name,
                        self.renew_s)  # fmt: skip
            return False

    def release(self) -> None:
        """Hand the Lease over at once on a clean stop instead of letting it expire."""
        for _ in range(3):  # a renewal still in flight may have bumped resourceVersion
            try:
                lease = self.kube.read_lease(self.namespace, self.name)
                if lease is None or read_state(lease).holder != self.identity:
                    return
                lease["spec"]["holderIdentity"] = ""
                self.kube.replace_lease(self.namespace, self.name, lease)
                log.info("released lease %s/%s", self.namespace, self.name)
                return
            except KubeError as exc:
                if exc.status != 409:
                    log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)
                    return
