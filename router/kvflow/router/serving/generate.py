"""Run a request's choices on workers: plan, carry the plan out, fail over, merge streams.

Each choice runs as its own task (n > 1, or several prompts) and they merge into one
stream. An attempt asks placement for a plan, then runs it. A worker that fails before the
client saw anything is excluded and placement makes a new plan; one that fails after the
client saw text ends the stream with an error (a buffered, non-streaming choice starts over
instead). Leaving the stream early (client gone, stop string) cancels the gRPC calls, which
aborts the request on the workers and frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflow.proto import worker_pb2 as pb
from kvflow.router import tracing
from kvflow.router.breaker.machine import Outcome
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import (
    ApiError,
    circuit_open,
    no_worker_available,
    worker_failed,
)
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.routing.block_hasher import CachedBlockHasher, PromptHashes
from kvflow.router.routing.placement import ExecutionPlan, Placement, PlacementRequest
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.choice_stream import ChoiceStream
from kvflow.router.serving.executor import AttemptFailedError, PlanExecutor, StreamBrokenError
from kvflow.router.serving.public_prefix import PublicPrefixes
from kvflow.router.serving.types import Caller, ChoiceSpec, ChoiceUsage, RequestTrace
from kvflow.router.text.tokenizer import TextTokenizer
from kvflow.router.workers.client import is_cancelling_this_task
from kvflow.router.workers.pool import WorkerPool
from kvflow.router.workers.records import GenerateInput, WorkerContext

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("kvflow.router.serving")

# Three workers failing one request in a row means a wider problem; say so (503) rather
# than walk the whole pool while the client waits.
MAX_ATTEMPTS = 3

_DONE = object()
# Choices started per turn of the event loop: other requests (and /health) get a turn
# between each batch of this many.
CHOICES_PER_LOOP_TURN = 16
ITEMS_PER_LOOP_TURN = 64


@dataclass
class _Verdict:
    """A choice's verdict for its pool's circuit: its last attempt's (None: none said
    anything of the workers, e.g. all were busy)."""

    outcome: Outcome | None = None


class GenerationService:
    def __init__(
        self,
        pool: WorkerPool,
        placement: Placement,
        executor: PlanExecutor,
        sessions: SessionTable,
        tokenizer: TextTokenizer,
        public_prefixes: PublicPrefixes,
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._placement = placement
        self._executor = executor
        self._sessions = sessions
        self._tokenizer = tokenizer
        self._public = public_prefixes
        self._metrics = metrics
        self._hasher = CachedBlockHasher()

    def model_info(self, model: str) -> pb.WorkerInfo:
        """A healthy worker's facts for ``model``, or a 503 when none is up."""
        info = self._pool.model_info(model)
        if info is None:
            raise no_worker_available(
                f"No healthy worker serves '{model}' right now "
                f"({self._pool.num_healthy()} of {len(self._pool)} workers healthy); retry shortly."
            )
        return info

    async def run(
        self, caller: Caller, specs: Sequence[ChoiceSpec], trace: RequestTrace, *, buffered: bool
    ) -> AsyncGenerator[ChoiceDelta | ChoiceUsage]:
        """Every choice's deltas, interleaved, then each choice's usage. Raises ApiError."""
        span = tracing.current_span()  # the request's (api/http.py); None when off
        if span is not None:
            span.set_attributes({"kvflow.request_id": trace.request_id,
                                 "gen_ai.request.model": caller.model,
                                 "kvflow.tenant": caller.tenant.name,
                                 "kvflow.num_choices": len(specs)})  # fmt: skip
        usage = UsageCounts()  # summed over the choices as they finish, for the span
        queue: asyncio.Queue[object] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []
        try:
            for spec in specs:
                tasks.append(
                    asyncio.create_task(self._choice_task(caller, spec, trace, queue, buffered))
                )
                # A task's first step (hashing its prompt, placing it) runs before its first
                # await; a thousand started at once would hold the event loop for that long.
                if len(tasks) % CHOICES_PER_LOOP_TURN == 0:
                    await asyncio.sleep(0)
            remaining = len(tasks)
            num_items = 0
            while remaining:
                num_items += 1
                if num_items % ITEMS_PER_LOOP_TURN == 0:
                    # queue.get() does not yield while items wait: thousands of choices'
                    # deltas would be merged in one turn of the loop.
                    await asyncio.sleep(0)
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    if isinstance(item, ApiError) and item.status == 503:
                        # Every worker tried refused it or failed: the class's refusals
                        # count it too, beside admission control's (KvflowRealtimeRejected).
                        self._metrics.class_rejections.labels(
                            caller.priority_class.value, "workers_refused"
                        ).inc()
                    raise item
                else:
                    assert isinstance(item, ChoiceDelta | ChoiceUsage)
                    if span is not None and isinstance(item, ChoiceUsage):
                        usage.add(item.usage)
                        _set_usage(span, usage)
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice_task(
        self,
        caller: Caller,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        buffered: bool,
    ) -> None:
        """Run one choice; whatever ends it but the request's own end (`run` cancelling
        it) puts the choice's last item on ``queue``: its done marker or its error. `run`
        waits for one of the two from every choice, so a task ending without either would
        hold the request (and its tenant's slots) until the client hung up."""
        try:
            await self._run_choice(caller, spec, trace, queue, buffered)
        except ApiError as exc:
            queue.put_nowait(exc)
        except asyncio.CancelledError:
            if is_cancelling_this_task():
                raise
            # A gRPC call cancelled beneath the choice (its channel closed) that no layer
            # below turned into a WorkerError: a bug, but the request must end, not hang.
            log.error("%s: choice %d: a worker call was cancelled beneath it",
                      trace.request_id, spec.index)  # fmt: skip
            queue.put_nowait(worker_failed("The worker's call was cancelled; retry the request."))
        except Exception as exc:  # a bug: surface it to the request as a 500, and log it
            log.exception("%s: choice %d failed", trace.request_id, spec.index)
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_DONE)

    def _plan(self, request: PlacementRequest) -> ExecutionPlan | None:
        started_s = time.perf_counter()
        # With the clock, placement counts what it sent in the last seconds as held by its
        # workers until their KV events confirm it (routing/in_flight.py).
        plan = self._placement.plan(request, self._pool.views(), time.monotonic())
        self._metrics.decision_s.observe(time.perf_counter() - started_s)
        if plan is not None:
            self._metrics.pd_decisions.labels(plan.decision, plan.reason.value).inc()
        return plan

    async def _run_choice(
        self,
        caller: Caller,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        buffered: bool,
    ) -> None:
        """One choice, its verdict after failover given to the pool's circuit breaker; a
        503 at once while that circuit refuses."""
        refusal = self._pool.circuit_refusal()
        if refusal is not None:
            raise circuit_open(self._pool.name, refusal.why, refusal.retry_after_s)
        ticket = self._pool.choice_started()
        verdict = _Verdict()
        try:
            await self._attempts(caller, spec, trace, queue, buffered, verdict)
        except StreamBrokenError as exc:
            verdict.outcome = exc.outcome
            raise exc.error from exc
        except ApiError:
            raise  # (its verdict is the last attempt's)
        except BaseException:
            verdict.outcome = None  # the client left (or a bug): nothing said of the pool
            raise
        finally:
            self._pool.choice_ended(ticket, verdict.outcome)

    async def _attempts(
        self,
        caller: Caller,
        spec: ChoiceSpec,
        trace: RequestTrace,
        queue: asyncio.Queue[object],
        buffered: bool,
        verdict: _Verdict,
    ) -> None:
        info = self.model_info(caller.model)
        tokens = spec.prompt_token_ids
        context = WorkerContext(
            cache_salt=caller.tenant.cache_salt,
            priority=caller.tenant.priority,
            num_public_blocks=self._public.num_public_blocks(tokens, info.block_size),
            tenant=caller.tenant.name,
            priority_class=caller.priority_class,
        )
        hashes = PromptHashes(self._hasher, tokens, info.block_size, info.hash_seed,
                              context.cache_salt, context.num_public_blocks)  # fmt: skip
        excluded: set[WorkerId] = set()
        last_failure = ""
        busy_retry_after_s: list[float] = []  # the hints of the workers that were full
        for attempt in range(MAX_ATTEMPTS):
            placing = PlacementRequest(caller.model, hashes, len(tokens), info.block_size,
                                       caller.session_key, frozenset(excluded))  # fmt: skip
            with tracing.span("kvflow.route") as route_span:
                plan = self._plan(placing)
                if route_span is not None:
                    _describe_plan(route_span, plan, spec.index, attempt)
            if plan is None:
                break
            trace.routes.append(f"choice={spec.index}; {plan.header_value()}")
            request = GenerateInput(
                request_id=trace.attempt_id(spec.index, attempt),
                prompt_token_ids=tokens,
                sampling=spec.sampling,
                context=context,
            )
            sink: list[ChoiceDelta | ChoiceUsage] = []
            trace.buffered_tokens.pop(spec.index, None)  # a new attempt holds nothing yet

            def hold(
                item: ChoiceDelta | ChoiceUsage,
                sink: list[ChoiceDelta | ChoiceUsage] = sink,
                index: int = spec.index,
            ) -> None:
                sink.append(item)
                if isinstance(item, ChoiceDelta):
                    trace.buffered_tokens[index] = item.num_completion_tokens

            choice = ChoiceStream(
                spec,
                self._tokenizer,
                hold if buffered else queue.put_nowait,
                lambda: self._first_message(caller, trace),
                self._metrics.itl_s.labels(caller.model).observe,
            )
            try:
                with tracing.span("kvflow.worker_attempt", tracing.CLIENT) as attempt_span:
                    if attempt_span is not None:
                        _describe_attempt(attempt_span, plan, request, attempt)
                    await self._executor.run(plan, request, choice, is_buffered=buffered)
            except AttemptFailedError as exc:
                last_failure = str(exc)
                log.warning("%s: failing over: %s", request.request_id, exc)
                excluded |= exc.worker_ids
                verdict.outcome = exc.outcome or verdict.outcome  # (busy: says nothing)
                self._placement.forget(plan, placing, exc.worker_ids)
                if exc.retry_after_s is not None:
                    busy_retry_after_s.append(exc.retry_after_s)
                self._metrics.failovers.inc()
                continue
            verdict.outcome = Outcome.SUCCESS
            for item in sink:
                queue.put_nowait(item)
            self._metrics.matched_blocks.inc(plan.matched_blocks)
            if (outcome := plan.prefix_outcome) is not None:
                self._metrics.prefix_outcomes.labels(outcome.value).inc()
            if caller.session_key:
                self._sessions.set(caller.session_key, plan.stream_worker)
            return
        raise no_worker_available(
            f"No worker could take this request for '{caller.model}'"
            + (f"; the last failure was {last_failure}" if last_failure else "")
            + "; retry shortly.",
            # The soonest a worker that refused for a full queue said it takes requests.
            retry_after_s=max(1.0, min(busy_retry_after_s, default=1.0)),
        )

    def _first_message(self, caller: Caller, trace: RequestTrace) -> None:
        if trace.first_token_s is None:
            trace.first_token_s = time.perf_counter()
            # caller.model: the served name (api/completions.py), so the label stays bounded.
            ttft_s = self._metrics.ttft_s.labels(caller.model, caller.priority_class.value)
            ttft_s.observe(trace.first_token_s - trace.arrival_s)


def _set_usage(span: Span, usage: UsageCounts) -> None:
    span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                         "gen_ai.usage.output_tokens": usage.completion_tokens,
                         "kvflow.usage.cached_tokens": usage.cached_tokens})  # fmt: skip


def _describe_plan(span: Span, plan: ExecutionPlan | None, choice: int, attempt: int) -> None:
    span.set_attributes({"kvflow.choice": choice, "kvflow.attempt": attempt})
    if plan is None:
        span.set_attribute("kvflow.route.plan", "none")
        return
    span.set_attributes({"kvflow.route.plan": plan.header_value(),
                         "kvflow.route.decision": plan.decision,
                         "kvflow.route.reason": plan.reason.value,
                         "kvflow.route.worker": str(plan.stream_worker),
                         "kvflow.route.matched_blocks": plan.matched_blocks})  # fmt: skip


def _describe_attempt(
    span: Span, plan: ExecutionPlan, request: GenerateInput, attempt: int
) -> None:
    span.set_attributes({"kvflow.worker_request_id": request.request_id,
                         "kvflow.attempt": attempt,
                         "kvflow.route.decision": plan.decision,
                         "server.address": str(plan.stream_worker),
                         "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})  # fmt: skip
