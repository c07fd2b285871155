"""The engine on its own thread, driven from asyncio.

One thread owns the ``Engine`` and everything in it, so the core needs no locks. asyncio
callers post commands to an inbox; the thread wakes, applies them, runs a step, and hands
each request's outputs back to its asyncio queue (``request_streams``). KV events and the
load are published from the same thread right after the step that caused them
(``loop_publish``), which is what makes a snapshot plus the events after it exact. A bug
or a broken part that hits one request fails that request alone (``request_teardown``
frees what it holds); the thread serves every other request on.

For prefill/decode disaggregation the loop also wires the engine to the KV transfer
agent through ``kv_handoff`` (reservations received, computed blocks sent; transfers run
on their own threads, so a 1 GiB gather or scatter never stalls this one, and end with a
command posted back here). Before this thread frees the blocks of a request in transfer,
it cancels the transfer, which returns only once nothing touches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import AsyncGenerator, Callable

from kvflow.engine_worker import request_teardown
from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.core.errors import (
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
)
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.kv_handoff import KvHandoff
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, SendStats
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.liveness import EngineHeartbeat
from kvflow.engine_worker.logits_processor import GuardedProcessor
from kvflow.engine_worker.loop_publish import load_snapshot, publish_kv_events
from kvflow.engine_worker.loop_records import (
    BlockIO,
    KvReservationOut,
    KvSubscription,
    LoadSnapshot,
    PrefillResult,
    StepObserver,
    TransferObserver,
)
from kvflow.engine_worker.request_streams import RequestStreams, raise_in
from kvflow.proto.priority_class import PriorityClass

log = logging.getLogger(__name__)

# When every request waits on a KV transfer, the loop sleeps this long between looks at
# the queue (commands still wake it at once): no busy spin, a few ms of latency at worst.
IDLE_WAIT_S = 0.005
# One step longer than this is a stuck engine thread (liveness.py says why a minute).
DEFAULT_STALL_TIMEOUT_S = 60.0
# Fault injection for tests only: the engine thread hangs for good in its Nth step, as a
# deadlocked kernel or a stuck collective would. Never set in production.
_FAULT_HANG_ON_STEP = int(os.environ.get("KVFLOW_FAULT_HANG_ON_STEP", "0"))


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        *,
        on_step: StepObserver | None = None,
        on_transfer: TransferObserver | None = None,
        kv: KvTransferAgent | None = None,
        blocks: BlockIO | None = None,
        heartbeat: EngineHeartbeat | None = None,
    ) -> None:
        self.engine = engine
        self.heartbeat = heartbeat or EngineHeartbeat(DEFAULT_STALL_TIMEOUT_S)
        self.on_step = on_step
        self.on_transfer = on_transfer
        self.kv = kv
        self.blocks = blocks
        assert (kv is None) == (blocks is None)
        self._cond = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._streams = RequestStreams(self._post, self._abort_now)
        self.handoff = (
            None
            if kv is None or blocks is None
            else KvHandoff(
                engine, kv, blocks, on_transfer=on_transfer,
                post=self._post_for, push=self._streams.push, deliver=self._streams.deliver,
            )
        )  # fmt: skip
        self.load = LoadSnapshot(num_total_blocks=engine.kv_cache.num_total_blocks)
        # Requests whose logits processor raised during the current step (GuardedProcessor).
        self._failed: dict[str, BaseException] = {}
        self._subscribers: list[KvSubscription] = []
        self._stopped = False
        self.is_draining = False
        self._num_steps = 0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # -- asyncio side ----------------------------------------------------------------------

    def start(self) -> None:
        self.heartbeat.watch(self._thread)
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
        tenant: str | None = None,
        remote_kv_timeout_s: float | None = None,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> AsyncGenerator[RequestOutput | KvReservationOut]:
        """Outputs of one request until it finishes. Leaving early aborts it and frees its
        blocks. Raises the engine's InvalidRequestError before the first output.

        With ``remote_kv_timeout_s`` (PD, decode side) the first item is a KvReservationOut;
        the request then waits up to that long for a prefill worker's blocks, else computes
        them itself."""
        self._check_accepting()
        wants_remote_kv = remote_kv_timeout_s is not None and self.kv is not None

        if sampling.logits_processor is not None:
            guarded = GuardedProcessor(sampling.logits_processor, request_id, self._failed)
            sampling = dataclasses.replace(sampling, logits_processor=guarded)

        def add() -> None:
            # The engine refuses a duplicate id first; only an accepted request's handoff
            # state is written (a refused one must not touch the running request's).
            self.engine.add_request(
                request_id,
                prompt_token_ids,
                sampling,
                cache_salt=cache_salt,
                num_public_blocks=num_public_blocks,
                priority=priority,
                tenant=tenant,
                wants_remote_kv=wants_remote_kv,
                priority_class=priority_class,
            )
            if wants_remote_kv:
                assert remote_kv_timeout_s is not None and self.handoff is not None
                self.handoff.remote_timeouts[request_id] = remote_kv_timeout_s

        # aclosing: leaving this generator early must close the inner one now (it aborts
        # the request), not whenever the event loop finalizes it.
        async with contextlib.aclosing(self._streams.open(request_id, add)) as stream:
            async for item in stream:
                assert isinstance(item, RequestOutput | KvReservationOut)
                yield item

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        target: SendTarget,
        *,
        first_token: int,
        end_token: int,
        timeout_s: float,
        cache_salt: str = "",
        num_public_blocks: int = 0,
        priority: int = 0,
        tenant: str | None = None,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> PrefillResult:
        """PD, prefill side: compute the prompt's KV and send blocks [first_token, end_token)
        to ``target``. Raises InvalidRequestError, EngineOverloadedError or KvTransferError;
        cancelling it aborts the request and frees its blocks."""
        self._check_accepting()
        handoff = self.handoff
        if handoff is None:
            raise EngineOverloadedError("this worker has no KV transport; it cannot prefill")

        def add() -> None:
            self.engine.add_prefill_request(
                request_id,
                prompt_token_ids,
                first_token=first_token,
                end_token=end_token,
                cache_salt=cache_salt,
                num_public_blocks=num_public_blocks,
                priority=priority,
                tenant=tenant,
                priority_class=priority_class,
            )
            handoff.send_targets[request_id] = (target, timeout_s)  # accepted: see generate

        stats: SendStats | None = None
        async with contextlib.aclosing(self._streams.open(request_id, add)) as stream:
            async for item in stream:
                if isinstance(item, SendStats):
                    stats = item
                elif isinstance(item, RequestOutput) and item.finish_reason is not None:
                    if stats is None:
                        # Aborted before its send (an Abort, a failed step ending every
                        # request): ABORTED for this request, not an assertion that reads
                        # as UNKNOWN, which the router counts as the worker down.
                        cause = RuntimeError(f"ended ({item.finish_reason}) before its KV "
                                             "was sent")  # fmt: skip
                        raise RequestFailedError(request_id, cause)
                    num_blocks = (end_token - first_token) // self._block_size
                    return PrefillResult(item, num_blocks, stats)
        raise AssertionError("a prefill stream ends with its final output")

    @property
    def _block_size(self) -> int:
        return self.engine.config.scheduler.block_size

    def _check_accepting(self) -> None:
        if self.is_draining:
            raise EngineOverloadedError("this worker is shutting down; send the request elsewhere")
        if (problem := self.heartbeat.problem()) is not None:
            # UNAVAILABLE to the router, which marks this worker down and goes elsewhere.
            raise EngineOverloadedError(f"this worker cannot serve: {problem}")

    def cancel_kv_transfer(self, request_id: str) -> bool:
        """PD decode: stop waiting for remote KV; the request computes its prompt here."""
        return self.kv is not None and self.kv.cancel(request_id)

    def abort(self, request_id: str) -> None:
        """Abort whichever request runs under this id (the Abort RPC: the router's call)."""
        self._post(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        out = request_teardown.abort(self.engine, self.kv, self.handoff, request_id)
        if out is not None:
            self._streams.deliver(out)

    def subscribe(self) -> KvSubscription:
        sub = KvSubscription(asyncio.get_running_loop())
        self._post(lambda: self._subscribers.append(sub))
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self._post(lambda: self._subscribers.remove(sub) if sub in self._subscribers else None)

    # -- engine thread -----------------------------------------------------------------------

    def _handle(self, out: RequestOutput) -> None:
        """One request's output: a failure here fails that request alone."""
        try:
            if out.kv_reserved is not None:
                assert self.handoff is not None
                self.handoff.on_reserved(out.request_id, out.kv_reserved)
            elif out.kv_to_send is not None:
                assert self.handoff is not None
                self.handoff.on_kv_ready(out.request_id, out.kv_to_send)
            else:
                self._streams.deliver(out)
        except Exception as exc:
            self._fail(out.request_id, exc)

    def _post_for(self, request_id: str, command: Callable[[], None]) -> None:
        """Queue a command that concerns one request: if it raises, that request fails."""

        def guarded() -> None:
            try:
                command()
            except Exception as exc:
                self._fail(request_id, exc)

        self._post(guarded)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """A bug or a broken part (a logits processor, handoff state) hit one request: end
        it and free what it holds, tell its stream why, and serve every other request on."""
        entry = self._streams.detach(request_id)
        request_teardown.free_failed(self.engine, self.kv, self.handoff, request_id)
        if isinstance(exc, InvalidRequestError):  # the request's own fault: a 400, not retried
            log.warning("request %s refused mid-generation: %s", request_id, exc)
            if entry is not None:
                raise_in(entry, exc)
            return
        log.error("request %s failed inside the worker: %r", request_id, exc, exc_info=exc)
        if entry is not None:
            raise_in(entry, RequestFailedError(request_id, exc))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopped
                    or self._inbox
                    or self.engine.has_schedulable_work
                    or any(s.needs_snapshot for s in self._subscribers)
                ):
                    self.heartbeat.waiting()
                    self._cond.wait()
                if self._stopped:
                    return
                self.heartbeat.working()
                commands, self._inbox = self._inbox, []
            for command in commands:
                try:
                    command()
                except Exception:  # a bug in one command must not stop the engine thread
                    log.exception("engine command failed")
            outputs: list[RequestOutput] = []
            if self.engine.has_schedulable_work:
                self._num_steps += 1
                if self._num_steps == _FAULT_HANG_ON_STEP:
                    threading.Event().wait()
                try:
                    outputs = self.engine.step()
                except Exception:  # a bug or out of memory: fail the batch, keep serving
                    log.exception("engine step failed; aborting every request in flight")
                    outputs = request_teardown.abort_all(self.engine, self.kv, self.handoff)
                failed = dict(self._failed)  # the dict itself is the processors' own
                self._failed.clear()
                for request_id, exc in failed.items():  # their tokens this step are void
                    self._fail(request_id, exc)
                for out in outputs:
                    if out.request_id not in failed:
                        self._handle(out)
                if self.engine.last_step_was_idle:
                    # Waiting requests that cannot be admitted until a transfer frees
                    # blocks: nap until a command arrives instead of spinning.
                    with self._cond:
                        if not self._inbox and not self._stopped:
                            self.heartbeat.waiting()
                            self._cond.wait(IDLE_WAIT_S)
                            self.heartbeat.working()
            try:
                publish_kv_events(self.engine.kv_cache.pool, self._subscribers)
                self._update_load()
                if self.on_step is not None:
                    self.on_step(self.engine, outputs, self.engine.clock())
            except Exception:  # events, load or metrics: never worth the engine thread
                log.exception("publishing a step's events, load or metrics failed")

    def _update_load(self) -> None:
        self.load = load_snapshot(self.engine)
