"""The uvicorn server, with a drain on SIGTERM (or Ctrl-C) instead of uvicorn's own stop.

uvicorn closes its listening socket on the first signal and gives open connections its
`timeout_graceful_shutdown` (5 s by default) before cutting them: /ready could never say
503 (nobody can connect), and a long stream was cut. Here the first signal only starts the
drain (api/drain.py); the server stops once nothing runs or the grace is over. A second
signal stops it at once, a third Ctrl-C without waiting for anything.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from kvflow.router.api.drain import DrainState

log = logging.getLogger("kvflow.router")

# How often the drain looks at what still runs: uvicorn's own main loop ticks at 0.1 s too.
DRAIN_POLL_S = 0.1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: DrainState) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler (it runs between two bytecodes of the loop's thread)."""
        if self._loop is None or not self.started or self._drain.is_draining:
            # Not serving yet, or a second signal: stop now. Unlike uvicorn's own handler,
            # the signal is not raised again after the stop, so the exit status is 0.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        assert self._loop is not None
        if not self._drain.begin(self._loop.time()):
            return
        log.info("draining: /ready answers 503, new requests 503; %d running, grace %g s",
                 self._drain.num_in_flight, self._drain.grace_s)  # fmt: skip
        self._drain_task = self._loop.create_task(self._stop_when_drained())

    async def _stop_when_drained(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._drain.is_done(loop.time()):
            await asyncio.sleep(DRAIN_POLL_S)
        if self._drain.num_in_flight:
            log.warning("drain grace of %g s over: cutting %d running requests",
                        self._drain.grace_s, self._drain.num_in_flight)  # fmt: skip
        else:
            log.info("drained: every request finished")
        self.should_exit = True
