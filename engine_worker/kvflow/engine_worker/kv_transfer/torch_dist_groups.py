"""The torch.distributed transport's pair groups: each two-rank process group formed on
demand, proven under the worker token, cached by name, and, once a transfer in it failed,
retired: marked broken in the store, parked until nothing can be pending in it, then
destroyed (torch_dist.py describes the scheme)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as _dist

from kvflow.engine_worker.kv_transfer.base import KvTransferError, PeerUnreachableError
from kvflow.engine_worker.kv_transfer.group_auth import HandshakeRefusedError, prove_peer
from kvflow.engine_worker.kv_transfer.nccl_watchdog import nccl_options
from kvflow.proto.transports import KvTransport

log = logging.getLogger(__name__)
# torch.distributed's stubs do not export the store and group classes used here.
dist: Any = _dist

# A failed group is destroyed this long after its operations' own timeout ran out: by then
# none can still be pending in it (gloo's run out at the group's timeout; NCCL's are
# polled to the transfer's deadline, and aborting the communicator ends any left).
BROKEN_GROUP_GRACE_S = 2.0


def make_group(kind: KvTransport, store: Any, name: str, rank: int, timeout_s: float) -> Any:
    prefixed = dist.PrefixStore(f"kvflow/group/{name}/", store)
    timeout = timedelta(seconds=max(timeout_s, 0.001))
    if kind is KvTransport.NCCL:
        return dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_options(timeout_s))
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


class PairGroups:
    """Both sides' groups of one transport: formed ones by name, and failed ones until they
    are destroyed."""

    def __init__(self, kind: KvTransport, token: str | None) -> None:
        self._kind = kind
        self._token = token
        self._lock = threading.Lock()
        self.formed: dict[str, Any] = {}  # group name -> process group
        self._group_locks: dict[str, threading.Lock] = {}  # group name -> its creation lock
        # Failed groups, until no operation can be pending in them (then destroyed).
        self.broken: list[Any] = []
        self.timeouts_s: dict[str, float] = {}  # group name -> its operations' timeout

    def is_formed(self, name: str) -> bool:
        with self._lock:
            return name in self.formed

    def group(
        self, store: Any, name: str, rank: int, deadline_s: float, device: torch.device
    ) -> Any:
        """The group ``name``, formed (and proven) on first use as ``rank`` through
        ``store``."""
        with self._lock:
            lock = self._group_locks.setdefault(name, threading.Lock())
        with lock:
            group = self.formed.get(name)
            if group is None:
                started = time.monotonic()
                timeout_s = deadline_s - started
                try:
                    group = make_group(self._kind, store, name, rank, timeout_s)
                except RuntimeError as exc:
                    raise PeerUnreachableError(f"forming KV group {name} failed: {exc}") from exc
                with self._lock:
                    self.timeouts_s[name] = max(timeout_s, 0.001)
                if self._token is not None:
                    self._prove_peer(group, name, rank, deadline_s, device)
                self.formed[name] = group
                log.info("KV group %s formed in %.1f ms", name, (time.monotonic() - started) * 1e3)
            return group

    def _prove_peer(
        self, group: Any, name: str, rank: int, deadline_s: float, device: torch.device
    ) -> None:
        assert self._token is not None
        try:
            prove_peer(group, name, rank, self._token, deadline_s, device)
        except HandshakeRefusedError as exc:
            log.warning("refused KV group %s: %s", name, exc)
            if exc.is_idle:
                self._destroy(group, name)
            else:  # an operation may be pending in it
                self._park(group, name)
            raise
        except KvTransferError:
            self._park(group, name)
            raise

    def retire(self, store: Any, name: str) -> None:
        """Never reuse ``name`` again, on either side: it may hold a half-done operation."""
        with self._lock:
            group = self.formed.pop(name, None)
        if group is not None:
            self._park(group, name)
        with contextlib.suppress(RuntimeError):  # the peer's store is gone: no reuse either
            store.set(f"kvflow/broken/{name}", "1")

    def _park(self, group: Any, name: str) -> None:
        """Keep a failed group until nothing can be pending in it, then destroy it."""
        with self._lock:
            self.broken.append(group)
            timeout_s = self.timeouts_s.get(name, 0.0)
        timer = threading.Timer(timeout_s + BROKEN_GROUP_GRACE_S, self._destroy, args=(group, name))
        timer.daemon = True
        timer.start()

    def _destroy(self, group: Any, name: str) -> None:
        """Close a group's connections: NCCL's communicator is aborted; a gloo group closes
        its pair sockets when its last reference goes, which is this one."""
        with self._lock:
            self.broken = [g for g in self.broken if g is not group]
            self.timeouts_s.pop(name, None)
        if self._kind is KvTransport.NCCL:
            with contextlib.suppress(Exception):  # already broken: abort is best effort
                group.abort()
        log.info("KV group %s destroyed", name)
