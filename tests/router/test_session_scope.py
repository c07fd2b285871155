"""A sticky session is its tenant's: the router's session table keys the client's
x-session-id under the tenant's name, so one tenant sending another's session id neither
reads nor moves the other's worker."""

from __future__ import annotations

from kvflow.router.routing.sessions import SessionTable
from kvflow.router.serving.types import Caller
from kvflow.router.tenants.config import Quotas, Tenant


def _caller(tenant: str, session_id: str | None) -> Caller:
    return Caller(Tenant(tenant, None, 0, Quotas(), cache_salt=tenant), "m", session_id)


def test_two_tenants_with_one_session_id_keep_their_own_workers() -> None:
    table = SessionTable()
    alice, mallory = _caller("alice", "conv-1"), _caller("mallory", "conv-1")
    assert alice.session_key != mallory.session_key
    table.set(alice.session_key or "", "worker-a")
    assert mallory.session_key is not None and table.get(mallory.session_key) is None
    table.set(mallory.session_key, "worker-b")
    assert table.get(alice.session_key or "") == "worker-a"


def test_no_session_id_is_no_session() -> None:
    assert _caller("alice", None).session_key is None
    assert _caller("alice", "").session_key is None
