"""The engine on its own thread, driven from asyncio.

One thread owns the ``Engine`` and everything in it, so the core needs no locks. asyncio
callers post commands to an inbox; the thread wakes, applies them, runs a step, and hands
each request's outputs back to its asyncio queue with ``call_soon_threadsafe``. KV events
are fanned out from the same thread right after the step that caused them, which is what
makes a snapshot plus the events after it exact.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.core.errors import EngineError, EngineOverloadedError
from kvflow.engine_worker.core.kv_events import KvEvent
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.proto.block_hash import BlockHash

log = logging.getLogger(__name__)

# A subscriber more than 4096 batches behind (tens of seconds of a busy worker) gets a
# fresh snapshot instead: cheaper than an unbounded queue, and exact.
MAX_PENDING_KV_BATCHES = 4096


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_cached_blocks: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_hit_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    seq: int
    block_hashes: list[BlockHash]


@dataclass(eq=False)
class KvSubscription:
    """What one subscriber has yet to read: a snapshot first, then event batches."""

    loop: asyncio.AbstractEventLoop
    pending: deque[KvSnapshot | list[KvEvent]] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    needs_snapshot: bool = True

    def push(self, item: KvSnapshot | list[KvEvent]) -> None:
        self.pending.append(item)
        self.loop.call_soon_threadsafe(self.wakeup.set)

    async def next(self) -> KvSnapshot | list[KvEvent]:
        while not self.pending:
            self.wakeup.clear()
            if not self.pending:
                await self.wakeup.wait()
        return self.pending.popleft()


StepObserver = Callable[[Engine, list[RequestOutput], float], None]


class EngineLoop:
    def __init__(self, engine: Engine, *, on_step: StepObserver | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.load = LoadSnapshot(num_total_blocks=engine.kv_cache.num_total_blocks)
        self._cond = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[object]]] = {}
        self._subscribers: list[KvSubscription] = []
        self._stopped = False
        self.is_draining = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # -- asyncio side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _post(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        cache_salt: str = "",
        num_public_blocks: int = 0,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Leaving early aborts it and frees its
        blocks. Raises the engine's InvalidRequestError before the first output."""
        if self.is_draining:
            raise EngineOverloadedError("this worker is shutting down; send the request elsewhere")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()

        def add() -> None:
            try:
                self.engine.add_request(
                    request_id,
                    prompt_token_ids,
                    sampling,
                    cache_salt=cache_salt,
                    num_public_blocks=num_public_blocks,
                    priority=priority,
                )
            except EngineError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
                return
            self._streams[request_id] = (loop, queue)

        self._post(add)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                assert isinstance(item, RequestOutput)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def abort() -> None:
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._deliver(out)

        self._post(abort)

    def subscribe(self) -> KvSubscription:
        sub = KvSubscription(asyncio.get_running_loop())
        self._post(lambda: self._subscribers.append(sub))
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self._post(lambda: self._subscribers.remove(sub) if sub in self._subscribers else None)

    # -- engine thread -----------------------------------------------------------------------

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if out.finish_reason is not None:
            self._streams.pop(out.request_id, None)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped
                    or self._inbox
                    or self.engine.has_unfinished_requests
                    or any(s.needs_snapshot for s in self._subscribers)
                ):
                    self._cond.wait()
                if self._stopped:
                    return
                commands, self._inbox = self._inbox, []
            for command in commands:
                command()
            outputs: list[RequestOutput] = []
            if self.engine.has_unfinished_requests:
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug or out of memory: fail the batch, keep serving
                    log.exception("engine step failed; aborting every request in flight")
                    outputs = self._abort_all()
                for out in outputs:
                    self._deliver(out)
            self._publish_kv_events()
            self._update_load()
            if self.on_step is not None:
                self.on_step(self.engine, outputs, self.engine.clock())

    def _abort_all(self) -> list[RequestOutput]:
        outs = [self.engine.abort_request(rid) for rid in list(self.engine.requests)]
        return [o for o in outs if o is not None and o.finish_reason is FinishReason.ABORT]

    def _publish_kv_events(self) -> None:
        pool = self.engine.kv_cache.pool
        events = pool.events.drain()
        for sub in self._subscribers:
            if len(sub.pending) > MAX_PENDING_KV_BATCHES:
                sub.pending.clear()
                sub.needs_snapshot = True
            if sub.needs_snapshot:
                sub.needs_snapshot = False
                sub.push(KvSnapshot(pool.events.last_seq, pool.cached_hashes()))
            elif events:
                sub.push(events)

    def _update_load(self) -> None:
        kv = self.engine.kv_cache
        self.load = LoadSnapshot(
            num_waiting=self.engine.scheduler.num_waiting,
            num_running=self.engine.scheduler.num_running,
            kv_usage=kv.pool.usage,
            num_cached_blocks=kv.pool.num_cached_blocks,
            num_free_blocks=kv.pool.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            prefix_hit_rate=kv.stats.hit_rate,
        )
