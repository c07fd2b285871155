"""Session affinity memory: the worker each recent session was last sent to."""

from __future__ import annotations

from collections import OrderedDict

from kvflow.router.routing.types import WorkerId

# 100k sessions x about 200 bytes an entry = about 20 MB per router replica.
DEFAULT_MAX_SESSIONS = 100_000


class SessionTable:
    """A bounded LRU map from session id to worker; the least recently used goes first."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        assert max_sessions > 0
        self._max_sessions = max_sessions
        self._workers: OrderedDict[str, WorkerId] = OrderedDict()

    def get(self, session_id: str) -> WorkerId | None:
        worker_id = self._workers.get(session_id)
        if worker_id is not None:
            self._workers.move_to_end(session_id)
        return worker_id

    def set(self, session_id: str, worker_id: WorkerId) -> None:
        self._workers[session_id] = worker_id
        self._workers.move_to_end(session_id)
        while len(self._workers) > self._max_sessions:
            self._workers.popitem(last=False)

    def forget_worker(self, worker_id: WorkerId) -> None:
        """A worker left the pool; its sessions start over wherever the scorers say."""
        for session_id in [s for s, w in self._workers.items() if w == worker_id]:
            del self._workers[session_id]

    def __len__(self) -> int:
        return len(self._workers)
