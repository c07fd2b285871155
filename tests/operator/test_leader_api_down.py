"""The leader election against an API server that does not answer (a restart, a network
blip), through the real `kubernetes` client: no answer is a KubeError like any other, so a
standby keeps waiting for the Lease (it once started leading), a leader whose renewals
fail learns it lost the Lease (its renewal task once died silently, and it led on beside
the next leader), and a renewal left hanging counts as failed within a renewal period."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from kubernetes import client

from kvflow.operator.kube import Kube, KubeError
from kvflow.operator.leader import LeaderElector


def _unreachable_kube() -> Kube:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    return Kube(client.ApiClient(configuration))


def test_no_answer_is_a_kube_error() -> None:
    with pytest.raises(KubeError) as failed:
        _unreachable_kube().read_lease("kvflow", "lease")
    assert failed.value.status == 0 and "did not answer" in failed.value.message


def test_a_standby_keeps_waiting_and_a_leader_learns_it_lost_the_lease() -> None:
    async def run() -> None:
        elector = LeaderElector(_unreachable_kube(), "kvflow", "lease", "me",
                                duration_s=2, renew_s=1)  # fmt: skip
        waiting = asyncio.create_task(elector.acquire())
        await asyncio.sleep(2.5)
        assert not waiting.done()  # neither leading nor crashed
        waiting.cancel()
        lost = asyncio.Event()
        started = time.monotonic()
        await asyncio.wait_for(elector.keep(lost), 10)
        assert lost.is_set() and time.monotonic() - started < 5

    asyncio.run(run())


class _Hanging(Kube):
    def read_lease(self, namespace: str, name: str) -> dict[str, object] | None:
        time.sleep(3)  # a call the client would let run 30 s
        return None


def test_a_renewal_left_hanging_fails_within_a_renewal_period() -> None:
    async def run() -> None:
        kube = _Hanging.__new__(_Hanging)  # no API client: nothing is called but read_lease
        elector = LeaderElector(kube, "kvflow", "lease", "me", duration_s=2, renew_s=1)
        started = time.monotonic()
        assert not await elector._attempt()
        assert time.monotonic() - started < 2

    asyncio.run(run())
