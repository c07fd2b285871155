"""Each request's asyncio stream, keyed by request id: the bridge between the engine thread
and the asyncio callers waiting on it.

An asyncio caller opens a stream by posting the command that admits its request; the engine
thread then hands the stream its items with ``call_soon_threadsafe``, and drops it with the
request's final output. A caller that leaves early has its request aborted, but only if the
stream is still the one registered under that id, never another stream's. Split from
``engine_loop``: the loop owns the thread and the engine, this owns which queue gets what.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.core.errors import EngineError, RequestFailedError

log = logging.getLogger(__name__)

# A request's stream, as the engine thread hands it items: its event loop and queue.
StreamEntry = tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]


class RequestStreams:
    def __init__(
        self, post: Callable[[Callable[[], None]], None], abort: Callable[[str], None]
    ) -> None:
        """``post`` queues a command for the engine thread; ``abort`` (run there) aborts
        whichever request runs under an id."""
        self._post = post
        self._abort = abort
        self._entries: dict[str, StreamEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    # -- asyncio side ----------------------------------------------------------------------

    async def open(self, request_id: str, add: Callable[[], None]) -> AsyncGenerator[object]:
        """Post ``add`` to the engine thread and yield what it delivers for the request
        until its final output; an exception delivered is raised. Leaving early aborts the
        request, if it is still this stream's: never another stream's under the same id."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        entry = (loop, queue)

        def register() -> None:
            try:
                add()  # raises before it changes anything (a duplicate id, bad input)
            except EngineError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
                return
            except Exception as exc:  # a bug: this request fails, the thread serves on
                log.exception("request %s: admitting it failed", request_id)
                loop.call_soon_threadsafe(queue.put_nowait, RequestFailedError(request_id, exc))
                return
            self._entries[request_id] = entry

        self._post(register)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = isinstance(item, RequestOutput) and item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort_own(request_id, entry)

    def _abort_own(self, request_id: str, entry: StreamEntry) -> None:
        """Abort the request only if ``entry``'s stream registered it and it still runs:
        a stream whose id was refused as a duplicate leaves the running one alone."""

        def abort() -> None:
            if self._entries.get(request_id) is entry:
                self._abort(request_id)

        self._post(abort)

    # -- engine thread -----------------------------------------------------------------------

    def deliver(self, out: RequestOutput) -> None:
        self.push(out.request_id, out)
        if out.finish_reason is not None:
            self._entries.pop(out.request_id, None)

    def push(self, request_id: str, item: object) -> None:
        target = self._entries.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def detach(self, request_id: str) -> StreamEntry | None:
        """Drop the request's stream, handing it back to be told how the request ended."""
        return self._entries.pop(request_id, None)


def raise_in(entry: StreamEntry, exc: BaseException) -> None:
    """Make a detached stream raise ``exc`` in its caller."""
    loop, queue = entry
    loop.call_soon_threadsafe(queue.put_nowait, exc)
